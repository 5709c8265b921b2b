"""Every config field transformers reads for Llama, Mistral, Qwen2, Qwen3 and Phi-3 is in specbuild's table (honoured,
refused or without effect); refused values are one line naming the field and value; honoured ones match transformers
exactly (RoPE frequencies of every implemented type, biases, tie_word_embeddings)."""

import inspect
import json
import re
import shutil

import numpy as np
import pytest
import torch
import transformers
from transformers import modeling_rope_utils

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint import config_fields
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.shapes import tiny_hf_config

pytestmark = pytest.mark.xdist_group("cli")

ARCHS = {
    "llama": (transformers.LlamaConfig, "transformers.models.llama.modeling_llama"),
    "mistral": (transformers.MistralConfig, "transformers.models.mistral.modeling_mistral"),
    "qwen2": (transformers.Qwen2Config, "transformers.models.qwen2.modeling_qwen2"),
    "qwen3": (transformers.Qwen3Config, "transformers.models.qwen3.modeling_qwen3"),
    "phi3": (transformers.Phi3Config, "transformers.models.phi3.modeling_phi3"),
    "gemma3": (transformers.Gemma3TextConfig, "transformers.models.gemma3.modeling_gemma3"),
}
CONFIG_READ = re.compile(r"""(?:config\.(\w+)|getattr\(\s*(?:self\.)?config\s*,\s*["'](\w+)["'])""")
ROPE_READ = re.compile(r"""rope_parameters(?:_dict)?(?:\[\s*layer_type\s*\])?(?:\.get\(|\[)\s*["'](\w+)["']""")
# the mask helpers these modeling files call
MASK_FUNCTIONS = ("create_causal_mask", "create_sliding_window_causal_mask")
# config attributes that are methods or class-level plumbing, not config.json fields
NOT_FIELDS = {"get_text_config", "standardize_rope_params", "rope_parameters_dict", "per_layer_config"}


def _fields_read_by_transformers() -> set[str]:
    import importlib

    from transformers import masking_utils

    names: set[str] = set()
    for config_cls, module_name in ARCHS.values():
        names |= set(config_cls.__dict__.get("__annotations__", {}))
        source = inspect.getsource(importlib.import_module(module_name))
        names |= {a or b for a, b in CONFIG_READ.findall(source)}
    for fn in MASK_FUNCTIONS:
        names |= {a or b for a, b in CONFIG_READ.findall(inspect.getsource(getattr(masking_utils, fn)))}
    return names - NOT_FIELDS


def _rope_keys_read_by_transformers() -> set[str]:
    keys: set[str] = set()
    for kind in {*config_fields.ROPE_TYPES, *config_fields.PHI3_ROPE_TYPES}:
        fn = modeling_rope_utils.ROPE_INIT_FUNCTIONS.get(kind)
        if fn is not None:
            keys |= set(ROPE_READ.findall(inspect.getsource(fn)))
    return keys


def test_every_field_transformers_reads_is_in_the_table():
    read = _fields_read_by_transformers()
    assert {"hidden_size", "sliding_window", "layer_types", "rope_parameters"} <= read  # the scan works
    missing = sorted(read - set(config_fields.FIELDS))
    assert not missing, f"transformers reads config fields that config_fields.FIELDS does not list: {missing}"
    rope = _rope_keys_read_by_transformers()
    assert {"factor", "low_freq_factor", "beta_fast", "long_factor"} <= rope
    missing = sorted(rope - set(config_fields.ROPE_FIELDS))
    assert not missing, f"transformers reads RoPE parameters that config_fields.ROPE_FIELDS does not list: {missing}"


def test_table_is_well_formed():
    for name, handling, note in config_fields.table_rows():
        assert handling in (config_fields.HONOURED, config_fields.REFUSED, config_fields.NO_EFFECT), name
        assert note, name


def _hf(shape="llama_gqa_llama3rope", **overrides) -> dict:
    cfg = tiny_hf_config(shape).to_dict()
    cfg.update(overrides)
    return cfg


REFUSED = [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(hidden_act="relu"), "hidden_act 'relu'"),
    (dict(is_causal=False), "is_causal false"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config"),
    (dict(pruned_heads={"0": [1]}), "pruned_heads"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type 'longrope'"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.factor is missing"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "x"}), "rope_scaling.factor 'x'"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25}, rope_scaling=None), "0.25"),
    (
        dict(rope_parameters={"full_attention": {"rope_type": "default"}}, rope_scaling=None),
        "per-layer-type RoPE",
    ),
    (dict(hidden_size="64"), "hidden_size '64' is not an integer"),
    (dict(num_hidden_layers=0), "num_hidden_layers 0"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps NaN"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings 'yes'"),
    (dict(eos_token_id="</s>"), "eos_token_id"),
    (dict(architectures=["GPT2LMHeadModel"]), "unknown architecture"),
]
PHI3_REFUSED = [  # (top-level fields, entries of rope_parameters, needle)
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), {}, "Phi-3 takes default or longrope"),
    ({}, dict(long_factor=None), "long_factor null is not a list of 8"),
    ({}, dict(type="su", long_factor=[1.0] * 7), "long_factor [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0] is not a list of 8"),
    ({}, dict(short_factor=[1.0] * 7 + [0.0]), "short_factor"),
    ({}, dict(partial_rotary_factor=0.3), "partial_rotary_factor 0.3 gives 9 rotary dims"),
    ({}, dict(partial_rotary_factor=1.5), "not a number in (0, 1]"),
]


def _phi3(top: dict, rope: dict) -> dict:
    raw = _hf("phi3_longrope", **top)
    raw["rope_parameters"] = {**raw["rope_parameters"], **rope}
    return raw


@pytest.mark.parametrize("top,rope,needle", PHI3_REFUSED, ids=[n[:40] for *_, n in PHI3_REFUSED])
def test_refused_phi3_values_name_the_field(top, rope, needle):
    with pytest.raises(SpecbuildError) as info:
        ModelConfig.from_hf(_phi3(top, rope), source="m/config.json")
    assert info.value.args[0].startswith("m/config.json") and needle in str(info.value) and "\n" not in str(info.value)


LONGROPES = [
    {},  # the shape's own: factor from max_position_embeddings / original_max_position_embeddings
    {"factor": 3.0},
    {"attention_factor": 1.7},
    {"type": "su", "rope_type": "su"},  # Phi3Config reads su (and yarn) as longrope
]


@pytest.mark.parametrize("extra", LONGROPES, ids=[",".join(e) or "own" for e in LONGROPES])
def test_longrope_and_partial_rotary_equal_transformers(extra):
    """The short- and long-factor frequencies over the rotary dims, the attention factor and the switch length, as
    Phi3RotaryEmbedding has them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = _phi3({}, extra)
    config = transformers.Phi3Config.from_dict(raw)
    model = transformers.Phi3ForCausalLM(config)
    ours = ModelConfig.from_hf(raw)
    original = raw["original_max_position_embeddings"]
    assert ours.rotary_dim == 16 and ours.rope_switch() == original
    inv, scale = ours.rope_frequencies()
    assert torch.equal(inv.to(torch.float32), model.model.rotary_emb.original_inv_freq)
    assert scale == pytest.approx(model.model.rotary_emb.attention_scaling, rel=1e-12)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original + 1)  # what transformers switches to
    assert not torch.equal(long, inv) and torch.equal(ours.long_rope_frequencies().to(torch.float32), long)


def test_partial_rotary_that_onnx_runtime_cannot_rotate_is_refused_at_build(tmp_path):
    """GroupQueryAttention rotates part of a head only in multiples of 16 dims: one line at build, nothing written."""
    from tests.shapes import tiny_hf_model

    tiny_hf_model("phi3_longrope", partial_rotary_factor=0.75, rope_scaling=None).save_pretrained(tmp_path / "hf")
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    with pytest.raises(SpecbuildError, match="partial rotary over 24 of 32 dims") as info:
        build_engine(ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY), log=quiet)
    assert "\n" not in str(info.value) and not (tmp_path / "engine").exists()


@pytest.mark.parametrize("overrides,needle", REFUSED, ids=[n for _, n in REFUSED])
def test_refused_values_name_the_field(overrides, needle):
    with pytest.raises(SpecbuildError) as info:
        ModelConfig.from_hf(_hf(**overrides), source="m/config.json")
    message = str(info.value)
    assert message.startswith("m/config.json") and needle in message and "\n" not in message


@pytest.mark.parametrize(
    "shape,overrides,needle",
    [
        ("qwen2_window", dict(use_sliding_window=False, layer_types=["sliding_attention"] * 3), "no sliding window"),
        ("qwen2_window", dict(layer_types=["full_attention"]), "layer_types"),
        ("mistral_window", dict(sliding_window=0), "sliding_window 0"),
    ],
)
def test_refused_attention_patterns(shape, overrides, needle):
    with pytest.raises(SpecbuildError, match=needle):
        ModelConfig.from_hf(_hf(shape, **overrides))


def test_sliding_window_resolution_follows_transformers():
    """Which layers slide, for each way a config can say it (checked against transformers' own resolution)."""
    cases = [
        ("mistral_window", {}),
        ("mistral_window", {"sliding_window": None}),
        ("qwen2_window", {}),
        ("qwen2_window", {"use_sliding_window": False}),
        ("qwen2_window", {"max_window_layers": 0}),
        ("qwen2_window", {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
        ("llama_gqa_llama3rope", {"sliding_window": 3, "use_sliding_window": True}),  # llama does not read them
        ("qwen3_window", {}),
        ("qwen3_window", {"use_sliding_window": False}),
        ("qwen3_window", {"layer_types": None, "max_window_layers": 2}),
        ("qwen3_qknorm", {"use_sliding_window": True, "sliding_window": 7}),  # max_window_layers 28 > layers
    ]
    for shape, overrides in cases:
        raw = _hf(shape, **overrides)
        raw.pop("layer_types", None) if overrides.get("layer_types") is None else None
        ours = ModelConfig.from_hf(raw)
        hf = type(tiny_hf_config(shape)).from_dict(raw)
        if shape.startswith("qwen"):
            want = [i for i, k in enumerate(hf.layer_types) if k == "sliding_attention"]
            window = hf.sliding_window if want else None
        elif shape.startswith("mistral"):
            window = hf.sliding_window
            want = list(range(hf.num_hidden_layers)) if window is not None else []
        else:
            window, want = None, []
        assert (ours.sliding_window if ours.sliding_layers else None, ours.sliding_layers) == (window, want), overrides
    # a Mistral config without the key gets transformers' default window (4096), not "none"
    raw = _hf("mistral_window")
    del raw["sliding_window"]
    assert ModelConfig.from_hf(raw).sliding_window == transformers.MistralConfig.from_dict(raw).sliding_window


def test_qwen3_defaults_follow_transformers():
    """head_dim defaults to Qwen3Config's 128 (not hidden / heads); attention_bias puts biases on q, k, v and o."""
    raw = _hf("qwen3_qknorm")
    del raw["head_dim"]
    hf = transformers.Qwen3Config.from_dict(raw)
    assert ModelConfig.from_hf(raw).head_dim == hf.head_dim == 128 != hf.hidden_size // hf.num_attention_heads
    biased = ModelConfig.from_hf(_hf("qwen3_window"))
    assert biased.attention_bias and biased.o_proj_bias and not biased.mlp_bias and biased.qk_norm
    plain = ModelConfig.from_hf(_hf("qwen3_qknorm"))
    assert not plain.attention_bias and not plain.o_proj_bias and plain.qk_norm


ROPES = [
    {"rope_type": "linear", "factor": 2.5},
    {"type": "linear", "factor": 3.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    {"rope_type": "dynamic", "factor": 1.7},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {
        "rope_type": "yarn",
        "factor": 3.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "mscale": 0.7,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "attention_factor": 1.3},
]


@pytest.mark.parametrize("rope", ROPES, ids=[f"{r.get('rope_type', r.get('type'))}{i}" for i, r in enumerate(ROPES)])
@pytest.mark.parametrize("top_level_original", [None, 48])
def test_rope_frequencies_equal_transformers(rope, top_level_original):
    raw = _hf(rope_scaling=rope, rope_theta=5000.0, max_position_embeddings=256)
    if top_level_original is not None:
        raw["original_max_position_embeddings"] = top_level_original
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(raw))
    want_inv, want_scale = model.model.rotary_emb.inv_freq, model.model.rotary_emb.attention_scaling
    inv, scale = ModelConfig.from_hf(raw).rope_frequencies()
    assert torch.equal(inv.to(torch.float32), want_inv)
    assert scale == pytest.approx(want_scale, rel=1e-12)


def _save(tmp_path, shape, seed=0, **overrides):
    """A transformers model with random non-trivial weights (biases included) saved to tmp_path/hf."""
    from tests.shapes import ALL_SHAPES

    config_cls, model_cls, kwargs = ALL_SHAPES[shape]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    model = getattr(transformers, model_cls)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    model.eval().save_pretrained(tmp_path / "hf")
    return model


def test_honoured_fields_reproduce_transformers(tmp_path):
    """Llama q/k/v/o and MLP biases and yarn RoPE (its attention factor scales cos/sin) in one engine; the other
    RoPE types differ only in frequencies, checked exactly above."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    model = _save(
        tmp_path, "llama_gqa_llama3rope", eos_token_id=None, attention_bias=True, mlp_bias=True, rope_scaling=yarn
    )
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    engine = Engine(
        build_engine(ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY, output_logits=True), log=quiet),
        threads=1,
    )
    ids = [1, 5, 9, 13, 7, 22, 3, 30, 11, 2, 4]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(engine.prefill_logits(ids) - want).max() < 1e-3
    prompt = [1, 5, 9, 3]
    assert engine.generate(input_ids=prompt, max_new_tokens=30).output_ids == hf_greedy(model, prompt, 30)


def test_fields_transformers_does_not_read_are_ignored_like_transformers():
    """Mistral never has q/k/v biases and Qwen2 always has them, whatever attention_bias says."""
    mistral = ModelConfig.from_hf(_hf("mistral_window", attention_bias=True, mlp_bias=True))
    assert (mistral.attention_bias, mistral.o_proj_bias, mistral.mlp_bias) == (False, False, False)
    qwen = ModelConfig.from_hf(_hf("qwen2_bias", attention_bias=False))
    assert (qwen.attention_bias, qwen.o_proj_bias) == (True, False)
    llama = ModelConfig.from_hf(_hf(attention_bias=True))
    assert (llama.attention_bias, llama.o_proj_bias) == (True, True)


def test_tied_config_with_a_distinct_lm_head_is_refused(tmp_path, tiny_hf_models):
    """transformers 4.x ties (ignoring the file's lm_head), 5.x keeps the file's lm_head: never guessed."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models["llama_gqa_llama3rope"], hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(SpecbuildError, match="tie_word_embeddings true but tensor lm_head.weight differs"):
        convert_checkpoint(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


GEMMA3_REFUSED = [
    (dict(final_logit_softcapping=-30.0), "final_logit_softcapping -30.0 is not a positive number"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention true"),
    (dict(hidden_activation="relu"), "hidden_activation 'relu'"),
    (
        dict(rope_parameters={"full_attention": {}, "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
        "sliding_attention.rope_type 'linear'",
    ),
    (dict(layer_types=["full_attention"]), "layer_types"),
]


@pytest.mark.parametrize("overrides,needle", GEMMA3_REFUSED, ids=[n for _, n in GEMMA3_REFUSED])
def test_refused_gemma3_values_name_the_field(overrides, needle):
    with pytest.raises(SpecbuildError) as info:
        ModelConfig.from_hf(_hf("gemma3_pattern", **overrides), source="m/config.json")
    assert info.value.args[0].startswith("m/config.json") and needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "legacy",
    [
        dict(sliding_window_pattern=3, rope_theta=50000.0, rope_local_base_freq=500.0),
        dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),  # on the global layers; Gemma 3 4B's kind
        {},  # every default: pattern 6, bases 1e6 and 1e4
    ],
)
def test_gemma3_layer_pattern_and_two_ropes_equal_transformers(legacy):
    """Which layers slide and both RoPEs, from config.json written with the legacy keys (rope_theta,
    rope_local_base_freq, rope_scaling, sliding_window_pattern) as from the per-layer-type rope_parameters."""
    raw = _hf("gemma3_pattern", num_hidden_layers=7, **legacy)
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    hf = transformers.Gemma3TextConfig.from_dict(raw)
    model = transformers.Gemma3ForCausalLM(hf)
    for written in (raw, hf.to_dict()):  # the legacy keys, and what save_pretrained writes from them
        ours = ModelConfig.from_hf(written)
        assert ours.sliding_layers == [i for i, k in enumerate(hf.layer_types) if k == "sliding_attention"]
        rope = model.model.rotary_emb
        inv, scale = ours.rope_frequencies()
        assert torch.equal(inv.to(torch.float32), rope.full_attention_inv_freq)
        assert scale == rope.full_attention_attention_scaling == 1.0
        assert torch.equal(ours.sliding_rope_frequencies().to(torch.float32), rope.sliding_attention_inv_freq)
        assert ours.attention_scale == hf.query_pre_attn_scalar**-0.5 and ours.embedding_scale == hf.hidden_size**0.5


def test_gemma3_defaults_follow_transformers():
    """A config.json that leaves out what Gemma3TextConfig defaults (head_dim, tying, window, scalar, bases)."""
    raw = {k: v for k, v in _hf("gemma3_pattern").items() if k in ("architectures", "model_type", "vocab_size")}
    raw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4)
    hf = transformers.Gemma3TextConfig.from_dict(raw)
    ours = ModelConfig.from_hf(raw)
    assert (ours.head_dim, ours.tie_word_embeddings, ours.sliding_window) == (hf.head_dim, True, hf.sliding_window)
    assert ours.sliding_layers == [i for i, k in enumerate(hf.layer_types) if k == "sliding_attention"]
    assert ours.attention_scale == hf.query_pre_attn_scalar**-0.5 and ours.hidden_act == "gelu_tanh"
    assert (ours.rope_theta, ours.sliding_rope_theta) == (1_000_000.0, 10_000.0)
    assert ours.eos_token_ids == [1] and ours.bos_token_id == 2


def test_gemma3_attention_softcapping_has_no_effect_in_transformers():
    """config_fields says NO_EFFECT for Gemma 3's attn_logit_softcapping because transformers' Gemma3Attention never
    applies it: were a transformers release to start, this fails and the engine must cap its scores too."""
    from tests.shapes import tiny_hf_model

    ids = torch.tensor([[2, 5, 9, 13, 7, 22, 3, 30, 11]])
    with torch.no_grad():
        logits = [tiny_hf_model("gemma3_untied", attn_logit_softcapping=cap)(ids).logits for cap in (None, 0.3)]
    assert torch.equal(*logits)
    assert config_fields.FIELDS["attn_logit_softcapping"].handling == config_fields.NO_EFFECT
