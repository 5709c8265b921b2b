"""The network without its layers' weights in memory: the streamed network computes what the loaded one computes,
every layer parameter the graph needs is made from the checkpoint, and the skeleton holds no layer data."""

import pytest
import torch

from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.network import lazy_network
from specbuild.builder.network.llama import LlamaNetwork
from tests.shapes import TINY_SHAPES


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_streamed_network_equals_the_loaded_one_and_every_weight_is_made(tiny_checkpoints, shape):
    ckpt = Checkpoint.load(tiny_checkpoints[shape])
    tensors = ckpt.tensors()
    loaded = LlamaNetwork.from_tensors(ckpt.model, tensors, "float32")
    skeleton = lazy_network.skeleton(ckpt.model, tensors)
    streamed = lazy_network.streamed(ckpt.model, tensors)
    params = dict(loaded.named_parameters())
    for name in ("embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(skeleton.weight(name), params[name]), name
        assert "Fake" in type(skeleton.get_parameter(name)).__name__
    assert torch.equal(skeleton.output_weight(), loaded.output_weight())
    for i, layer in enumerate(loaded.layers):
        names = lazy_network.layer_parameters(layer)
        assert names and not any(n.startswith(lazy_network.UNPACKED) for n in names)
        for name in names:
            made = skeleton.weight(f"layers.{i}.{name}")
            assert torch.equal(made, params[f"layers.{i}.{name}"]), name
            assert "Fake" in type(skeleton.get_parameter(f"layers.{i}.{name}")).__name__, name
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    args = (ids, torch.arange(5)[None], torch.tril(torch.ones(5, 5, dtype=torch.bool))[None], torch.tensor([0]))
    cfg = ckpt.model
    kv = torch.zeros(cfg.num_layers, 2, 1, cfg.num_kv_heads, 0, cfg.head_dim)
    with torch.no_grad():
        assert torch.equal(loaded(*args, kv)[0], streamed(*args, kv)[0])
    assert sum(p.numel() for p in streamed.parameters() if p.device.type != "meta") == loaded.norm.weight.numel()


def test_a_weight_the_network_holds_is_not_read_from_the_checkpoint(tiny_checkpoints):
    tensors = Checkpoint.load(tiny_checkpoints["qwen2_bias"]).tensors()
    with pytest.raises(KeyError, match="not a weight the network reads"):
        lazy_network.network_weight(tensors, "norm.weight", torch.float32)


def _counting(ckpt):
    """The checkpoint's tensors, counting how often each is read."""
    tensors, reads = ckpt.tensors(), {}

    class Counting(dict):
        def __getitem__(self, name):
            reads[name] = reads.get(name, 0) + 1
            return tensors[name]

    return Counting({name: None for name in tensors}), reads


def test_a_streamed_network_holding_reads_each_weight_once_within_its_budget(tiny_checkpoints):
    ckpt = Checkpoint.load(tiny_checkpoints["llama_tied_linear"])
    cfg = ckpt.model
    assert cfg.tie_word_embeddings
    counting, reads = _counting(ckpt)
    streamed = lazy_network.streamed(cfg, counting)
    streamed.tie_output()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    args = (ids, torch.arange(5)[None], torch.tril(torch.ones(5, 5, dtype=torch.bool))[None], torch.tensor([0]))
    kv = torch.zeros(cfg.num_layers, 2, 1, cfg.num_kv_heads, 0, cfg.head_dim)
    loaded = LlamaNetwork.from_tensors(cfg, ckpt.tensors(), "float32")
    with torch.no_grad():
        want = loaded(*args, kv)[0]
        with streamed.holding(1 << 40):
            for _ in range(3):
                assert torch.equal(streamed(*args, kv)[0], want)
        assert reads and set(reads.values()) == {1}
        reads.clear()
        embedding = cfg.vocab_size * cfg.hidden_size * 4
        with streamed.holding(embedding):  # room for the embedding alone: the layers are read on every call
            for _ in range(2):
                assert torch.equal(streamed(*args, kv)[0], want)
        assert reads.pop("model.embed_tokens.weight") == 1 and set(reads.values()) == {2}
        reads.clear()
        for _ in range(2):  # outside holding(): read at each use
            streamed(*args, kv)
        assert set(reads.values()) == {2}
        reads.clear()
        streamed.lm_head(torch.zeros(1, 2, cfg.hidden_size))  # the tied lm_head reads the embedding
        assert reads == {"model.embed_tokens.weight": 1}
