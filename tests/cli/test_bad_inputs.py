"""Adversarial corpus, inputs side: real-world checkpoint variants and faults given to `specbuild convert` / `build`.

Every case must end in one `error:` line naming the file, tensor, field or value, exit code 1, and nothing on disk
(no output directory, no temporary sibling). Classes covered here: config fields that change the math, non-finite
weights, unreadable or corrupt inputs (config, weights, tokenizer, chat template), unbounded build options. The
other classes of the corpus live beside the code they test: sliding windows (tests/builder/test_sliding_window.py),
config-field honouring against transformers (tests/builder/checkpoint/test_config_fields.py), EAGLE-3 layouts
(tests/plugins/test_eagle_convert.py), engine integrity and manifests (tests/runtime/test_integrity.py,
test_manifest.py), sampling values (tests/cli/test_cli.py), interruption and never destroying user data
(tests/cli/test_interrupt.py, tests/test_fsutil.py).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from specbuild.cli.main import cli
from tests.helpers import write_char_tokenizer
from tests.plugins.eagle_fixtures import write_eagle1_head
from tests.plugins.medusa_helpers import write_medusa_heads
from tests.plugins.redrafter_fixtures import write_redrafter

pytestmark = pytest.mark.xdist_group("cli")

MODEL = "llama_gqa_llama3rope"  # vocab 97, hidden 64


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_refused(result, out: Path, *needles):
    """Exit 1, exactly one `error:` line naming every needle, and nothing left next to `out`."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert not out.exists()
    left = [p.name for p in out.parent.iterdir() if p.name.startswith(".")]
    assert not left, f"temporary files left: {left}"


def _hf_copy(tiny_hf_models, tmp_path, name=MODEL) -> Path:
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models[name], hf)
    return hf


def _edit_config(hf: Path, **changes) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


def _edit_weights(hf: Path, edit) -> None:
    tensors = load_file(str(hf / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------- convert: config, weights, tokenizer


def test_a_good_tokenizer_and_template_pass(tiny_hf_models, tmp_path):
    hf = _hf_copy(tiny_hf_models, tmp_path)
    write_char_tokenizer(hf)
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    res = invoke("convert", "--model-dir", hf, "--output-dir", tmp_path / "ckpt")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()


def _nan(t):
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")


def _inf(t):
    t["model.norm.weight"][0] = float("inf")


def _huge(t):
    t["model.layers.0.self_attn.k_proj.weight"][0, 0] = 1e6  # fine in float32, Inf in float16


def _truncate(path: Path, keep: float = 0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


CONVERT_CASES = {
    # config fields that change the math
    "gelu activation": (lambda hf: _edit_config(hf, hidden_act="gelu_pytorch_tanh"), ["hidden_act", "gelu"]),
    "bidirectional": (lambda hf: _edit_config(hf, is_causal=False), ["is_causal false"]),
    "partial rotary": (lambda hf: _edit_config(hf, partial_rotary_factor=0.5), ["partial_rotary_factor 0.5"]),
    "longrope": (
        lambda hf: _edit_config(
            hf, rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
        ),
        ["rope_type 'longrope'"],
    ),
    "quantized": (lambda hf: _edit_config(hf, quantization_config={"quant_method": "awq"}), ["quantization_config"]),
    "tied but distinct lm_head": (lambda hf: _edit_config(hf, tie_word_embeddings=True), ["tie_word_embeddings"]),
    "heads not a divisor": (lambda hf: _edit_config(hf, num_key_value_heads=3), ["num_key_value_heads 3"]),
    # non-finite weights
    "NaN weight": (lambda hf: _edit_weights(hf, _nan), ["model.layers.1.mlp.up_proj.weight", "non-finite"]),
    "Inf weight": (lambda hf: _edit_weights(hf, _inf), ["model.norm.weight", "non-finite"]),
    # unreadable or corrupt inputs
    "config is a directory": (
        lambda hf: ((hf / "config.json").unlink(), (hf / "config.json").mkdir()),
        ["config.json"],
    ),
    "config not UTF-8": (lambda hf: (hf / "config.json").write_bytes(b"\xff\xfe{}"), ["config.json", "UTF-8"]),
    "config a list": (lambda hf: (hf / "config.json").write_text("[1, 2]"), ["config.json", "JSON object"]),
    "truncated weights": (lambda hf: _truncate(hf / "model.safetensors"), ["model.safetensors"]),
    "weights a directory": (
        lambda hf: ((hf / "model.safetensors").unlink(), (hf / "model.safetensors").mkdir()),
        ["model.safetensors"],
    ),
    "bad generation eos": (
        lambda hf: (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"})),
        ["generation_config.json", "eos_token_id"],
    ),
    "truncated tokenizer": (
        lambda hf: (write_char_tokenizer(hf), _truncate(hf / "tokenizer.json", 0.6)),
        ["tokenizer.json", "not a valid tokenizer"],
    ),
    "tokenizer of another model": (
        lambda hf: write_char_tokenizer(hf, vocab_offset=500),
        ["tokenizer.json", "outside the model's vocab_size 97"],
    ),
    "tokenizer without decoder": (
        lambda hf: write_char_tokenizer(hf, decoder=False),
        ["tokenizer.json", "does not round-trip"],
    ),
    "broken chat template": (
        lambda hf: (
            write_char_tokenizer(hf),
            (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"})),
        ),
        ["tokenizer_config.json", "chat template"],
    ),
    "tokenizer_config not JSON": (
        lambda hf: (hf / "tokenizer_config.json").write_text("{chat_template: x"),
        ["tokenizer_config.json", "invalid JSON"],
    ),
}


@pytest.mark.parametrize("case", list(CONVERT_CASES))
def test_convert_refuses(tiny_hf_models, tmp_path, case):
    hf = _hf_copy(tiny_hf_models, tmp_path)
    edit, needles = CONVERT_CASES[case]
    edit(hf)
    out = tmp_path / "ckpt"
    assert_refused(invoke("convert", "--model-dir", hf, "--output-dir", out), out, *needles)


def test_float16_overflow_is_refused_not_turned_into_inf(tiny_hf_models, tmp_path):
    hf = _hf_copy(tiny_hf_models, tmp_path)
    _edit_weights(hf, _huge)
    out = tmp_path / "ckpt"
    res = invoke("convert", "--model-dir", hf, "--output-dir", out, "--dtype", "float16")
    assert_refused(res, out, "model.layers.0.self_attn.k_proj.weight", "float16")
    assert invoke("convert", "--model-dir", hf, "--output-dir", out, "--dtype", "bfloat16").exit_code == 0


def test_non_finite_head_weights_are_refused(tiny_hf_models, tmp_path):
    hf = _hf_copy(tiny_hf_models, tmp_path)
    heads = tmp_path / "heads"
    write_medusa_heads(heads, "v0.1-pt", 64, 97, num_heads=2)
    state = torch.load(heads / "medusa_lm_head.pt", weights_only=True)
    state["1.0.linear.bias"][2] = float("-inf")
    torch.save(state, heads / "medusa_lm_head.pt")
    out = tmp_path / "ckpt"
    res = invoke("convert", "--model-dir", hf, "--medusa-dir", heads, "--output-dir", out)
    assert_refused(res, out, "medusa_lm_head.pt", "1.0.linear.bias", "non-finite")


@pytest.mark.parametrize(
    "case",
    ["missing ResBlock", "wrong exit_dim", "vocab mismatch"],
)
def test_broken_redrafter_checkpoints_are_one_line(tiny_hf_models, tmp_path, case):
    """A ReDrafter drafter that does not fit the base: exit 1, one line naming the tensor or field, nothing left."""
    from safetensors.torch import save_file

    hf = _hf_copy(tiny_hf_models, tmp_path)
    drafter = tmp_path / "drafter"
    state = write_redrafter(drafter, 64, 97, exit_dim=64, layers=2)
    if case == "missing ResBlock":
        save_file(
            {k: v for k, v in state.items() if not k.startswith("lm_head.1.")}, str(drafter / "model.safetensors")
        )
        needles = ["model.safetensors", "lm_head.1.linear.weight is missing"]
    elif case == "wrong exit_dim":
        cfg = json.loads((drafter / "config.json").read_text())
        (drafter / "config.json").write_text(json.dumps({**cfg, "exit_dim": 128}))
        needles = ["input_proj", "exit_dim 128"]
    else:
        save_file({**state, "lm_head.2.weight": torch.zeros(98, 64)}, str(drafter / "model.safetensors"))
        needles = ["lm_head.2.weight", "[98, 64]", "[97, 64]"]
    out = tmp_path / "ckpt"
    res = invoke("convert", "--model-dir", hf, "--redrafter-dir", drafter, "--output-dir", out)
    assert_refused(res, out, *needles)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_weights_are_one_line(tiny_hf_models, tmp_path):
    hf = _hf_copy(tiny_hf_models, tmp_path)
    (hf / "model.safetensors").chmod(0)
    out = tmp_path / "ckpt"
    assert_refused(invoke("convert", "--model-dir", hf, "--output-dir", out), out, "model.safetensors", "ermission")


# ---------------------------------------------------------------- build: option bounds


@pytest.fixture(scope="module")
def checkpoints(tiny_hf_models, tmp_path_factory):
    """mode -> canonical checkpoint of the tiny model with random heads (none, medusa, eagle)."""
    root = tmp_path_factory.mktemp("bad_inputs")
    hf = tiny_hf_models[MODEL]
    cfg = json.loads((hf / "config.json").read_text())
    write_medusa_heads(root / "medusa-heads", "v2", 64, 97, num_heads=3)
    write_eagle1_head(root / "eagle-head", cfg)
    out = {}
    for mode, heads in (
        ("none", []),
        ("medusa", ["--medusa-dir", root / "medusa-heads"]),
        ("eagle", ["--eagle-dir", root / "eagle-head"]),
    ):
        res = invoke("convert", "--model-dir", hf, "--output-dir", root / mode, *heads)
        assert res.exit_code == 0, res.output
        out[mode] = root / mode
    return out


BIG_TREE = [[i] for i in range(97)] + [[a, b] for a in range(5) for b in range(97)]  # 583 nodes
BUILD_CASES = {
    "absurd eagle depth": ("eagle", ["--eagle-depth", "1000"], ["--eagle-depth 1000", "between 1 and 16"]),
    "eagle top-k beyond vocab": ("eagle", ["--eagle-top-k", "500"], ["--eagle-top-k 500", "97"]),
    "eagle total tokens": ("eagle", ["--eagle-total-tokens", "100000"], ["--eagle-total-tokens 100000"]),
    "eagle tree rank beyond vocab": ("eagle", ["--tree", "[[0],[200]]"], ["[200]", "top-k"]),
    "eagle tree and dynamic": ("eagle", ["--tree", "chain4", "--eagle-top-k", "3"], ["exclude each other"]),
    "medusa top-k 0": ("medusa", ["--medusa-top-k", "0"], ["--medusa-top-k 0"]),
    "medusa top-k beyond vocab": ("medusa", ["--medusa-top-k", "98"], ["--medusa-top-k 98", "between 1 and 97"]),
    "medusa tree rank beyond top-k": ("medusa", ["--tree", "[[0],[12]]", "--medusa-top-k", "5"], ["[12]"]),
    "medusa tree too large": ("medusa", ["--tree", json.dumps(BIG_TREE), "--medusa-top-k", "97"], ["at most 512"]),
    "option of another mode": ("eagle", ["--medusa-top-k", "3"], ["--medusa-top-k", "medusa"]),
    "tree for none": ("none", ["--tree", "chain4"], ["--tree does not apply"]),
    "typical for none": ("none", ["--typical-acceptance", "0.09,0.3"], ["--typical-acceptance"]),
    "typical NaN": ("medusa", ["--typical-acceptance", "nan,0.3"], ["--typical-acceptance"]),
    "max-seq-len 1": ("none", ["--max-seq-len", "1"], ["--max-seq-len 1"]),
    "max-seq-len beyond model": ("none", ["--max-seq-len", "100000"], ["--max-seq-len 100000", "256"]),
    "max-seq-len below tree": ("medusa", ["--max-seq-len", "4", "--tree", "[[0],[0,0],[0,0,0]]"], ["--max-seq-len 4"]),
    "fp16 plan without tensorrt": ("none", ["--fp16-plan"], ["--fp16-plan", "--tensorrt"]),
    "max-draft-len 0": ("medusa", ["--max-draft-len", "0"], ["--max-draft-len 0"]),
}


@pytest.mark.parametrize("case", list(BUILD_CASES))
def test_build_refuses_before_any_work(checkpoints, tmp_path, case):
    mode, flags, needles = BUILD_CASES[case]
    out = tmp_path / "engine"
    started = time.perf_counter()
    res = invoke(
        "build", "--checkpoint-dir", checkpoints[mode], "--output-dir", out, "--speculative-mode", mode, *flags
    )
    assert_refused(res, out, *needles)
    assert time.perf_counter() - started < 15  # refused up front, not after an export (or a hang)


@pytest.mark.parametrize(
    "recipe,needles",
    [
        ({"build": {"max_seq_len": "abc"}}, ["--max-seq-len 'abc'"]),
        ({"build": {"output_logits": "yes"}}, ["--output-logits 'yes'"]),
        ({"build": {"speculative_mode": "medusa", "medusa_top_k": 2.5}}, ["--medusa-top-k 2.5"]),
        ({"build": {"typical_acceptance": [0.1]}}, ["--typical-acceptance"]),
        ({"build": {"validate_tolerance": -1}}, ["--validate-tolerance -1"]),
        ("build: [unclosed", ["invalid YAML"]),
    ],
)
def test_bad_recipe_values_are_one_line(checkpoints, tmp_path, recipe, needles):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe))
    out = tmp_path / "engine"
    res = invoke("build", "--checkpoint-dir", checkpoints["medusa"], "--output-dir", out, "--recipe", path)
    assert_refused(res, out, "recipe.yaml", *needles)
