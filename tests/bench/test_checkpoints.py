"""Random checkpoints at real shapes (bench.checkpoints): sharded like the Hub's, loadable by transformers, with a
tokenizer whose vocabulary matches the model's and the chat template the prompt sets need."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specbuild.bench.checkpoints import SHAPES, model_tensors, write_checkpoint
from specbuild.builder.checkpoint.fused_tensors import unfuse
from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.checkpoint.weights_io import spec_of


def test_a_tiny_checkpoint_is_sharded_loadable_and_chats(tmp_path):
    out = write_checkpoint("tiny-llama", tmp_path / "hf", shard_bytes=4 << 20, log=lambda *_: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == model.config.vocab_size
    prompt = tok.apply_chat_template([{"role": "user", "content": "def fib(n):"}], tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    assert "def fib(n):" in prompt and prompt != "def fib(n):"
    with torch.no_grad():
        logits = model(torch.tensor([tok(prompt)["input_ids"]])).logits[0, -1]
    assert logits.std() > 0.1  # weights at a realistic scale: the logits are not flat


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_lists_the_tensors_transformers_makes(shape):
    """The tensors written for a shape are exactly those of transformers' model of its config (shapes and names; the
    model made on the meta device: no memory at 8B)."""
    import transformers

    cfg = SHAPES[shape]
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    assert model_tensors(cfg) == want
    model_config = ModelConfig.from_hf(cfg)
    parts = unfuse(model_config, {n: torch.empty(s, device="meta") for n, s in want.items()}, shape)
    assert {n: spec_of(parts, n)[0] for n in parts} == model_config.expected_shapes()  # Phi-3: once split
