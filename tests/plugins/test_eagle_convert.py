"""EAGLE-1/2 and EAGLE-3 head conversion: published layouts round-trip, classic faults convert, broken heads fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specbuild.builder.checkpoint import Checkpoint
from specbuild.builder.convert import convert_checkpoint
from specbuild.errors import SpecbuildError
from tests.conftest import tiny_hf_config, tiny_hf_model
from tests.plugins.eagle_fixtures import (
    EAGLE3_TO_MODELOPT,
    eagle3_state,
    save_state,
    write_eagle1_head,
    write_eagle3_head,
)

pytestmark = pytest.mark.xdist_group("eagle")

LLAMA = "llama_gqa_llama3rope"  # H 64, V 97, 4 heads / 2 kv heads of 16, intermediate 96, 2 layers
QWEN = "qwen2_bias"


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle_bases")
    out = {}
    for name, shape, overrides in ((LLAMA, LLAMA, {}), (QWEN, QWEN, {}), ("llama8", LLAMA, {"num_hidden_layers": 8})):
        tiny_hf_model(shape, **overrides).save_pretrained(root / name)
        out[name] = root / name
    return out


def _convert(base_dir: Path, tmp_path: Path, mode: str, head_dir: Path) -> Checkpoint:
    out = convert_checkpoint(base_dir, tmp_path / "ckpt", heads={mode: head_dir}, progress=False)
    return Checkpoint.load(out)


def _fails(base_dir: Path, tmp_path: Path, mode: str, head_dir: Path, *needles: str) -> str:
    out = tmp_path / "ckpt"
    with pytest.raises(SpecbuildError) as err:
        convert_checkpoint(base_dir, out, heads={mode: head_dir}, progress=False)
    msg = str(err.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    assert not out.exists() and not list(tmp_path.glob(".ckpt*")), "a failed convert left output behind"
    return msg


def _strip(state: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in state.items()}


@pytest.mark.parametrize(
    "fmt, fc_bias, with_embed, num_layers, config_layers, prefix, config_extra",
    [
        ("bin", True, True, 1, None, "", {}),  # Vicuna EAGLE-1: own (different) embedding copy, fc.bias
        ("safetensors", False, False, 1, None, "", {"bias": None}),  # LLaMA-3 head without fc.bias, no `bias` key
        ("bin", False, False, 2, 1, "ea_layer.", {"bias": True}),  # config lies about layers and bias
        ("sharded", True, False, 1, 3, "model.", {}),
    ],
)
def test_eagle1_round_trip(bases, tmp_path, fmt, fc_bias, with_embed, num_layers, config_layers, prefix, config_extra):
    state = write_eagle1_head(
        tmp_path / "head",
        tiny_hf_config(LLAMA),
        fmt=fmt,
        fc_bias=fc_bias,
        with_embed=with_embed,
        num_layers=num_layers,
        config_layers=config_layers,
        prefix=prefix,
        config_extra=config_extra,
    )
    ckpt = _convert(bases[LLAMA], tmp_path, "eagle", tmp_path / "head")
    cfg = ckpt.heads["eagle"]
    assert cfg["version"] == 1 and cfg["num_layers"] == num_layers
    assert cfg["fc_bias"] is fc_bias and cfg["qkv_bias"] is False and cfg["has_embed"] is with_embed
    assert (cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (4, 2, 16, 96)
    assert cfg["draft_vocab_size"] is None and cfg["defaults"] == {}
    tensors = ckpt.head_tensors("eagle")
    expected = _strip(state, prefix)
    assert set(tensors) == set(expected)
    assert "layers.0.input_layernorm.weight" not in tensors
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name


def test_eagle1_embedding_equal_to_base_is_dropped(bases, tmp_path):
    base_embed = load_file(str(bases[LLAMA] / "model.safetensors"))["model.embed_tokens.weight"]
    cfg = tiny_hf_config(LLAMA)
    write_eagle1_head(tmp_path / "head", cfg, embed=base_embed, config_extra={"specbuild_defaults": {"eagle_top_k": 4}})
    ckpt = _convert(bases[LLAMA], tmp_path, "eagle", tmp_path / "head")
    assert ckpt.heads["eagle"]["has_embed"] is False and ckpt.heads["eagle"]["defaults"] == {"eagle_top_k": 4}
    assert "embed_tokens.weight" not in ckpt.head_tensors("eagle")


def test_eagle1_qwen2_qkv_bias(bases, tmp_path):
    state = write_eagle1_head(tmp_path / "head", tiny_hf_config(QWEN), fmt="safetensors", qkv_bias=True)
    ckpt = _convert(bases[QWEN], tmp_path, "eagle", tmp_path / "head")
    cfg = ckpt.heads["eagle"]
    assert cfg["qkv_bias"] is True and (cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]) == (2, 1, 16)
    tensors = ckpt.head_tensors("eagle")
    for proj in ("q_proj", "k_proj", "v_proj"):
        key = f"layers.0.self_attn.{proj}.bias"
        assert torch.equal(tensors[key], state[key])


def test_eagle1_reduced_vocab_extension(bases, tmp_path):
    state = write_eagle1_head(tmp_path / "head", tiny_hf_config(LLAMA), draft_vocab=30)
    ckpt = _convert(bases[LLAMA], tmp_path, "eagle", tmp_path / "head")
    assert ckpt.heads["eagle"]["draft_vocab_size"] == 30
    tensors = ckpt.head_tensors("eagle")
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], state["d2t"])
    assert torch.equal(tensors["lm_head.weight"], state["lm_head.weight"])


@pytest.mark.parametrize(
    "layout, fmt, draft_vocab",
    [("original", "bin", 40), ("original", "safetensors", None), ("modelopt", "safetensors", 40)],
)
def test_eagle3_round_trip(bases, tmp_path, layout, fmt, draft_vocab):
    write_eagle3_head(tmp_path / "head", tiny_hf_config(LLAMA), layout=layout, fmt=fmt, draft_vocab=draft_vocab)
    state = eagle3_state(tiny_hf_config(LLAMA), draft_vocab=draft_vocab)  # canonical (SafeAILab) names
    ckpt = _convert(bases[LLAMA], tmp_path, "eagle3", tmp_path / "head")
    cfg = ckpt.heads["eagle3"]
    vd = draft_vocab or 97
    assert cfg["version"] == 3 and cfg["draft_vocab_size"] == vd and cfg["target_hidden_size"] == 64
    assert cfg["has_embed"] is False and cfg["layout"] == layout  # no embed_tokens: the base embedding is used
    assert cfg["capture_layers"] == [1, 1, 0]  # [2, L//2, L-3] clamped into the 2-layer toy model
    assert (cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (4, 2, 16, 96)
    tensors = ckpt.head_tensors("eagle3")
    state.pop("t2d", None)
    if draft_vocab is None:
        state["d2t"] = torch.zeros(97, dtype=torch.int64)
    assert set(tensors) == set(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name
    assert tensors["d2t"].dtype == torch.int64


def test_eagle3_capture_layers(bases, tmp_path):
    write_eagle3_head(tmp_path / "a", tiny_hf_config(LLAMA), draft_vocab=40)
    assert _convert(bases["llama8"], tmp_path / "a", "eagle3", tmp_path / "a").heads["eagle3"]["capture_layers"] == [
        2,
        4,
        5,
    ]
    aux = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 7]}}
    write_eagle3_head(tmp_path / "b", tiny_hf_config(LLAMA), layout="modelopt", config_extra=aux)
    ckpt = _convert(bases["llama8"], tmp_path / "b", "eagle3", tmp_path / "b")
    assert ckpt.heads["eagle3"]["capture_layers"] == [1, 4, 8]


def test_eagle3_smaller_draft_hidden_needs_its_embedding(bases, tmp_path):
    small = {**tiny_hf_config(LLAMA).to_dict(), "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    extra = {"target_hidden_size": 64}
    state = write_eagle3_head(tmp_path / "head", small, fmt="safetensors", draft_vocab=40, config_extra=extra)
    state["fc.weight"] = 0.3 * torch.randn(32, 3 * 64)
    save_state(state, tmp_path / "head", "safetensors")
    _fails(bases[LLAMA], tmp_path, "eagle3", tmp_path / "head", "embed_tokens.weight is missing", "(97, 32)")
    state["embed_tokens.weight"] = 0.5 * torch.randn(97, 32)
    save_state(state, tmp_path / "head", "safetensors")
    cfg = _convert(bases[LLAMA], tmp_path, "eagle3", tmp_path / "head").heads["eagle3"]
    assert cfg["has_embed"] is True and cfg["hidden_size"] == 32 and cfg["target_hidden_size"] == 64


def _broken_eagle1(tmp_path: Path, mutate) -> Path:
    state = write_eagle1_head(tmp_path / "head", tiny_hf_config(LLAMA))
    mutate(state)
    save_state(state, tmp_path / "head", "bin")
    return tmp_path / "head"


def _broken_eagle3(tmp_path: Path, mutate, layout: str = "original") -> Path:
    state = write_eagle3_head(tmp_path / "head", tiny_hf_config(LLAMA), layout=layout, draft_vocab=40)
    mutate(state)
    save_state(state, tmp_path / "head", "bin")
    return tmp_path / "head"


def test_eagle1_missing_tensor_is_named(bases, tmp_path):
    head = _broken_eagle1(tmp_path, lambda s: s.pop("layers.0.mlp.down_proj.weight"))
    _fails(bases[LLAMA], tmp_path, "eagle", head, "pytorch_model.bin", "layers.0.mlp.down_proj.weight", "(64, 96)")


def test_eagle1_misshaped_fc(bases, tmp_path):
    head = _broken_eagle1(tmp_path, lambda s: s.update({"fc.weight": torch.randn(64, 192)}))
    _fails(bases[LLAMA], tmp_path, "eagle", head, "fc.weight has shape (64, 192), expected (64, 128)")


def test_eagle1_wrong_hidden_size(bases, tmp_path):
    write_eagle1_head(tmp_path / "head", tiny_hf_config(LLAMA, hidden_size=48, head_dim=12))
    _fails(bases[LLAMA], tmp_path, "eagle", tmp_path / "head", "fc.weight has shape (48, 96)", "hidden_size 64")


def test_eagle1_unexpected_tensor(bases, tmp_path):
    head = _broken_eagle1(tmp_path, lambda s: s.update({"norm.weight": torch.ones(64)}))
    _fails(bases[LLAMA], tmp_path, "eagle", head, "unexpected tensor", "norm.weight")


def _d2t_out_of_range(state):
    state["d2t"][-1] = 200


def _d2t_not_increasing(state):
    state["d2t"][3] = state["d2t"][2] - 1
    state.pop("t2d")


def _t2d_disagrees(state):
    state["t2d"][state["t2d"].nonzero()[0]] = False


@pytest.mark.parametrize(
    "mutate, needles",
    [
        (_d2t_out_of_range, ("d2t maps draft id 39", "outside the base vocabulary [0, 97)")),
        (_d2t_not_increasing, ("d2t maps draft ids 2 and 3", "strictly increasing")),
        (_t2d_disagrees, ("t2d and d2t disagree",)),
        (lambda s: s.pop("d2t"), ("d2t is missing (expected shape (40))",)),
        (lambda s: s.pop("midlayer.mlp.down_proj.weight"), ("midlayer.mlp.down_proj.weight is missing",)),
        (
            lambda s: s.update({"fc.weight": torch.randn(64, 128)}),
            ("fc.weight has shape (64, 128), expected (64, 192)",),
        ),
    ],
)
def test_eagle3_broken_heads_fail(bases, tmp_path, mutate, needles):
    head = _broken_eagle3(tmp_path, mutate)
    _fails(bases[LLAMA], tmp_path, "eagle3", head, "pytorch_model.bin", *needles)


def test_eagle3_modelopt_missing_tensor_uses_its_name(bases, tmp_path):
    name = "eagle_module." + EAGLE3_TO_MODELOPT["midlayer.input_layernorm.weight"]
    head = _broken_eagle3(tmp_path, lambda s: s.pop(name), layout="modelopt")
    _fails(bases[LLAMA], tmp_path, "eagle3", head, "eagle_module.input_embeds_norm.weight is missing")
