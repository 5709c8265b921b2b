"""EAGLE-1/2 and EAGLE-3 head conversion: published layouts round-trip, classic faults convert, broken heads fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.errors import SpecbuildError
from tests.plugins.eagle_fixtures import (
    EAGLE3_TO_MODELOPT,
    eagle3_state,
    save_state,
    speculators_config,
    write_eagle1_head,
    write_eagle3_head,
)
from tests.shapes import tiny_hf_config, tiny_hf_model

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
    ckpt = _convert(bases["llama8"], tmp_path / "out-a", "eagle3", tmp_path / "a")
    assert ckpt.heads["eagle3"]["capture_layers"] == [2, 4, 5]
    aux = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 7]}}
    write_eagle3_head(tmp_path / "b", tiny_hf_config(LLAMA), layout="modelopt", config_extra=aux)
    ckpt = _convert(bases["llama8"], tmp_path / "out-b", "eagle3", tmp_path / "b")
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


# speculators (vLLM) layout: speculators_model_type "eagle3", transformer_layer_config, layers.0.*


def _spec_head(tmp_path: Path, base_cfg=None, **kwargs) -> dict:
    return write_eagle3_head(tmp_path / "head", base_cfg or tiny_hf_config(LLAMA), layout="speculators", **kwargs)


@pytest.mark.parametrize(
    "norm_before_residual, draft_vocab, fmt", [(True, 40, "safetensors"), (False, None, "bin"), (None, 40, "sharded")]
)
def test_eagle3_speculators_round_trip(bases, tmp_path, norm_before_residual, draft_vocab, fmt):
    base_embed = load_file(str(bases[LLAMA] / "model.safetensors"))["model.embed_tokens.weight"]
    state = _spec_head(
        tmp_path, draft_vocab=draft_vocab, fmt=fmt, norm_before_residual=norm_before_residual, embed=base_embed
    )
    assert "layers.0.hidden_norm.weight" in state and not any(k.startswith("midlayer.") for k in state)
    ckpt = _convert(bases[LLAMA], tmp_path, "eagle3", tmp_path / "head")
    cfg = ckpt.heads["eagle3"]
    assert cfg["layout"] == "speculators" and cfg["version"] == 3
    # a config without the key gets vLLM's default (true); speculators' own class default would be false
    assert cfg["norm_before_residual"] is (True if norm_before_residual is None else norm_before_residual)
    assert cfg["draft_vocab_size"] == (draft_vocab or 97) and cfg["capture_layers"] == [1, 1, 0]
    assert cfg["has_embed"] is False  # the verifier's embedding copy equals the base's: dropped
    expected = eagle3_state(tiny_hf_config(LLAMA), draft_vocab=draft_vocab)  # canonical (SafeAILab) names
    expected.pop("t2d", None)
    expected.setdefault("d2t", torch.zeros(97, dtype=torch.int64))
    tensors = ckpt.head_tensors("eagle3")
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name


def test_eagle3_speculators_dims_come_from_transformer_layer_config(bases, tmp_path):
    """Sizes are read from transformer_layer_config (here 4 kv heads and intermediate 48, unlike the base model's
    2 and 96); the top level of a speculators config holds no hidden_size or head counts."""
    layer = {**tiny_hf_config(LLAMA).to_dict(), "num_key_value_heads": 4, "intermediate_size": 48, "rms_norm_eps": 1e-5}
    _spec_head(tmp_path, layer, draft_vocab=40, config_extra={"eagle_aux_hidden_state_layer_ids": [0, 4, 8]})
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert "hidden_size" not in config and config["transformer_layer_config"]["num_key_value_heads"] == 4
    cfg = _convert(bases["llama8"], tmp_path, "eagle3", tmp_path / "head").heads["eagle3"]
    assert (cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (4, 4, 16, 48)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["hidden_size"] == 64
    assert cfg["capture_layers"] == [0, 4, 8]  # vLLM's indexing: the input of layer i, 8 = the last layer's output


def test_eagle3_speculators_names_without_speculators_config(bases, tmp_path):
    """layers.0.hidden_norm marks the layout even under a flat config; norm_before_residual then defaults to false."""
    state = _spec_head(tmp_path, draft_vocab=40)
    save_state(state, tmp_path / "head", "bin")
    (tmp_path / "head" / "config.json").write_text(json.dumps(tiny_hf_config(LLAMA).to_dict()))
    cfg = _convert(bases[LLAMA], tmp_path, "eagle3", tmp_path / "head").heads["eagle3"]
    assert cfg["layout"] == "speculators" and cfg["norm_before_residual"] is False


def _spec_config(tmp_path: Path, **changes) -> Path:
    file = tmp_path / "head" / "config.json"
    config = json.loads(file.read_text())
    for key, value in changes.items():
        if key == "layer":
            config["transformer_layer_config"].update(value)
        else:
            config[key] = value
    file.write_text(json.dumps(config))
    return tmp_path / "head"


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"speculators_model_type": "eagle"}, ("speculators_model_type 'eagle' is not an EAGLE-3 head", "midlayer")),
        ({"speculators_model_type": "mlp_speculator"}, ("'mlp_speculator'", "supported EAGLE-3 layouts")),
        ({"layer": {"model_type": "qwen3"}}, ("transformer_layer_config model_type 'qwen3' is not supported",)),
        ({"norm_before_fc": True}, ("norm_before_fc",)),
        ({"norm_before_residual": "yes"}, ("norm_before_residual must be true or false",)),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}, ("[1, 2, 3] names layer 3, outside [0, 2]",)),
        ({"transformer_layer_config": None}, ("needs transformer_layer_config",)),
    ],
)
def test_eagle3_speculators_bad_config_fails(bases, tmp_path, changes, needles):
    _spec_head(tmp_path, draft_vocab=40)
    _fails(bases[LLAMA], tmp_path, "eagle3", _spec_config(tmp_path, **changes), "config.json", *needles)


def _extra_q_norm(state):
    state["layers.0.self_attn.q_norm.weight"] = torch.ones(16)


def _second_layer(state):
    state["layers.1.mlp.down_proj.weight"] = torch.ones(64, 96)


@pytest.mark.parametrize(
    "mutate, needles",
    [
        (_extra_q_norm, ("unexpected tensor in an EAGLE-3 head (speculators layout)", "layers.0.self_attn.q_norm")),
        (_second_layer, ("multi-layer speculators EAGLE-3 heads (layers.1.*) are not supported",)),
        (lambda s: s.pop("layers.0.hidden_norm.weight"), ("layers.0.hidden_norm.weight is missing",)),
        (lambda s: s.pop("layers.0.mlp.up_proj.weight"), ("layers.0.mlp.up_proj.weight is missing", "(96, 64)")),
        (lambda s: s.update({"fc.bias": torch.zeros(64)}), ("unexpected tensor", "fc.bias")),
        (lambda s: s.update({"t2d": torch.ones(97, dtype=torch.bool)}), ("t2d and d2t disagree",)),
    ],
)
def test_eagle3_speculators_broken_heads_fail(bases, tmp_path, mutate, needles):
    state = _spec_head(tmp_path, draft_vocab=40)
    mutate(state)
    save_state(state, tmp_path / "head", "bin")
    _fails(bases[LLAMA], tmp_path, "eagle3", tmp_path / "head", "pytorch_model.bin", *needles)


def test_eagle3_speculators_config_without_layers_names_what_it_found(bases, tmp_path):
    state = write_eagle1_head(tmp_path / "head", tiny_hf_config(LLAMA))  # EAGLE-1 names ...
    state = {k.replace("layers.0.", "decoder.0."): v for k, v in state.items()}
    save_state(state, tmp_path / "head", "bin")
    cfg = speculators_config(tiny_hf_config(LLAMA), draft_vocab=97)  # ... under a speculators config
    (tmp_path / "head" / "config.json").write_text(json.dumps(cfg))
    _fails(
        bases[LLAMA],
        tmp_path,
        "eagle3",
        tmp_path / "head",
        "speculators_model_type 'eagle3') holds no layers.0.*",
        "decoder.0.mlp.down_proj.weight",
    )


def test_eagle3_unknown_layout_names_found_and_supported_layouts(bases, tmp_path):
    """Tensors of no known layout: one line with a sample of the names found and the layouts supported."""
    (tmp_path / "head").mkdir()
    state = {f"transformer.h.0.attn.{p}.weight": torch.randn(64, 128) for p in ("q", "k", "v")}
    state["transformer.wte.weight"] = torch.randn(97, 64)
    save_state(state, tmp_path / "head", "safetensors")
    (tmp_path / "head" / "config.json").write_text(json.dumps({"architectures": ["Eagle3Whatever"]}))
    msg = _fails(
        bases[LLAMA],
        tmp_path,
        "eagle3",
        tmp_path / "head",
        "no supported EAGLE-3 layout found",
        "transformer.h.0.attn.k.weight",
        "midlayer.*",
        "eagle_module.",
        "speculators_model_type",
    )
    assert "supported layouts" in msg


def test_eagle1_head_given_as_eagle3_names_the_layout_problem(bases, tmp_path):
    write_eagle1_head(tmp_path / "head", tiny_hf_config(LLAMA))
    _fails(
        bases[LLAMA],
        tmp_path,
        "eagle3",
        tmp_path / "head",
        "no supported EAGLE-3 layout found",
        "fc.weight",
        "looks like an EAGLE-1/2 head (--eagle-dir)",
        "supported layouts",
    )
