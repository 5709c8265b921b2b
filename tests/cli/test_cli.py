"""The `specbuild` CLI end to end on a tiny model: convert -> build (recipe + flag override) -> run -> inspect, and
the one-line `error:` contract (exit 1, nothing partial left behind) for the common user mistakes."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from click.testing import CliRunner

from specbuild.cli.main import cli

pytestmark = pytest.mark.xdist_group("cli")

MODEL = "llama_gqa_llama3rope"  # vocab 97, eos 2


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *needles):
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.stdout == ""


@pytest.fixture(scope="module")
def built(tiny_hf_models, tmp_path_factory):
    """(checkpoint dir, engine dir) converted and built through the CLI; the engine has max_seq_len 16."""
    root = tmp_path_factory.mktemp("cli")
    ckpt, engine = root / "ckpt", root / "engine"
    res = invoke("convert", "--model-dir", tiny_hf_models[MODEL], "--output-dir", ckpt)
    assert res.exit_code == 0, res.output
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"build": {"speculative_mode": "none", "max_seq_len": 64}}))
    res = invoke("build", "--checkpoint-dir", ckpt, "--output-dir", engine, "--recipe", recipe, "--max-seq-len", 16)
    assert res.exit_code == 0, res.output
    return ckpt, engine


def test_recipe_value_overridden_by_flag(built):
    _, engine = built
    info = json.loads(invoke("inspect", engine, "--json").stdout)
    assert info["kind"] == "engine"
    assert info["speculative_mode"] == "none"
    assert info["limits"]["max_seq_len"] == 16


def test_inspect_checkpoint_and_engine(built):
    ckpt, engine = built
    res = invoke("inspect", ckpt, "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["kind"] == "checkpoint"
    assert (info["layers"], info["hidden_size"], info["num_heads"], info["num_kv_heads"]) == (2, 64, 4, 2)
    assert info["vocab_size"] == 97 and info["dtype"] == "float32" and info["tie_word_embeddings"] is False
    assert info["rope"]["scaling"]["rope_type"] == "llama3"
    assert info["tensors"] > 0 and info["bytes"] > 0 and info["heads"] == {}
    info = json.loads(invoke("inspect", engine, "--json").stdout)
    assert "model.onnx" in info["files"] and "engine.yaml" in info["files"]
    portable = next(g for g in info["graphs"] if g["backend"] == "tensorrt")
    assert {i["name"] for i in portable["io"]["inputs"]} >= {"input_ids", "kv_cache", "tree_mask"}
    assert info["validation"]["max_abs_diff"] <= info["validation"]["tolerance"]
    for path in (ckpt, engine):  # the rich rendering works too
        res = invoke("inspect", path)
        assert res.exit_code == 0 and res.stdout.strip(), res.output
    assert "None" not in res.stdout and " KV" in res.stdout  # a float cache is named without a precision


def test_run_json_fields_and_seeded_determinism(built):
    _, engine = built
    args = ("run", "--engine-dir", engine, "--input-ids", "5,17,42", "--max-new-tokens", 6, "--json")
    sampled = (*args, "--temperature", 0.9, "--top-k", 20, "--top-p", 0.95, "--seed", 7)
    first, second = invoke(*sampled), invoke(*sampled)
    assert first.exit_code == 0, first.output
    out = json.loads(first.stdout)
    for key in ("output_ids", "text", "steps", "mean_accepted_tokens", "ttft_s", "tokens_per_s"):
        assert key in out
    assert 1 <= len(out["output_ids"]) <= 6
    assert json.loads(second.stdout)["output_ids"] == out["output_ids"]
    greedy = json.loads(invoke(*args).stdout)
    assert greedy["mean_accepted_tokens"] == pytest.approx(1.0) or greedy["steps"] == 0
    # the portable (TensorRT) graph run on ONNX Runtime gives the same greedy ids
    portable = json.loads(invoke(*args, "--graph", "tensorrt").stdout)
    assert portable["output_ids"] == greedy["output_ids"]
    assert_one_line_error(invoke(*args, "--graph", "cuda"), "--graph")


def test_run_without_json_prints_ids_and_stats(built):
    _, engine = built
    res = invoke("run", "--engine-dir", engine, "--input-ids", "5,17,42", "--max-new-tokens", 4)
    assert res.exit_code == 0, res.output
    ids = [int(x) for x in res.stdout.split()]
    assert 1 <= len(ids) <= 4
    assert "tok/s" in res.stderr and "TTFT" in res.stderr


def test_unknown_mode_is_one_line_error(built, tmp_path):
    ckpt, _ = built
    out = tmp_path / "engine"
    res = invoke("build", "--checkpoint-dir", ckpt, "--output-dir", out, "--speculative-mode", "bogus")
    assert_one_line_error(res, "bogus")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_missing_checkpoint_dir(tmp_path):
    out = tmp_path / "engine"
    res = invoke("build", "--checkpoint-dir", tmp_path / "nope", "--output-dir", out)
    assert_one_line_error(res, "nope")
    assert list(tmp_path.iterdir()) == []
    res = invoke("convert", "--model-dir", tmp_path / "nope", "--output-dir", tmp_path / "ckpt")
    assert_one_line_error(res, "nope")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ids", ["1,x", "", "1,,-3", "1.5"])
def test_bad_input_ids(built, ids):
    _, engine = built
    assert_one_line_error(invoke("run", "--engine-dir", engine, "--input-ids", ids), "--input-ids")


def test_prompt_longer_than_max_seq_len(built):
    _, engine = built
    ids = ",".join(["5"] * 20)
    assert_one_line_error(invoke("run", "--engine-dir", engine, "--input-ids", ids), "max_seq_len")


def test_prompt_and_input_ids_exclusive(built):
    _, engine = built
    assert_one_line_error(invoke("run", "--engine-dir", engine), "--prompt")


def test_engine_of_another_format_version(built, tmp_path):
    _, engine = built
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    manifest = yaml.safe_load((copy / "engine.yaml").read_text())
    manifest["format_version"] = 99
    (copy / "engine.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    assert_one_line_error(invoke("run", "--engine-dir", copy, "--input-ids", "1,2"), "version 99")
    assert_one_line_error(invoke("inspect", copy), "version 99")


def test_bad_typical_acceptance_and_recipe(built, tmp_path):
    ckpt, _ = built
    out = tmp_path / "engine"
    res = invoke("build", "--checkpoint-dir", ckpt, "--output-dir", out, "--typical-acceptance", "0.1")
    assert_one_line_error(res, "EPS,ALPHA")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("build:\n  no_such_option: 1\n")
    res = invoke("build", "--checkpoint-dir", ckpt, "--output-dir", out, "--recipe", recipe)
    assert_one_line_error(res, "no_such_option")
    assert not out.exists()


@pytest.mark.parametrize(
    "option,value",
    [
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--temperature", "-1"),
        ("--temperature", "1e-8"),  # below the graph's 1e-5 floor: refused, not silently clamped
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--top-p", "nan"),
        ("--top-k", "-1"),
        ("--seed", "-1"),
        ("--threads", "0"),
        ("--threads", "-2"),
        ("--max-new-tokens", "0"),
    ],
)
def test_invalid_sampling_value_is_one_line_error(built, option, value):
    _, engine = built
    res = invoke("run", "--engine-dir", engine, "--input-ids", "1,2", option, value)
    assert_one_line_error(res, option)


def test_module_entry_point_knows_every_command():
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "specbuild.cli.main", "train", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert "--recipe" in res.stdout


def test_mode_and_weights_are_choices_in_help(tmp_path):
    from specbuild import engine_format as ef
    from specbuild.modes.registry import mode_names

    help_text = invoke("build", "--help").stdout
    assert f"[{'|'.join(mode_names())}]" in help_text and f"[{'|'.join(ef.WEIGHTS)}]" in help_text
    res = invoke("build", "--checkpoint-dir", tmp_path, "--output-dir", tmp_path / "e", "--weights", "int3")
    assert_one_line_error(res, "--weights 'int3'", "int4")


def test_demo_shows_a_speculative_mode_beside_none():
    from types import SimpleNamespace

    from specbuild.cli.demo import _demo_summary, demo_mode
    from specbuild.modes.registry import baseline_mode, get_mode

    assert not get_mode(demo_mode()).baseline
    none = SimpleNamespace(tokens_per_s=40.0, mean_accepted_tokens=1.0, output_ids=[5, 6, 7])
    fast = SimpleNamespace(tokens_per_s=60.0, mean_accepted_tokens=1.9, output_ids=[5, 6, 7])
    lines = _demo_summary({baseline_mode(): none, demo_mode(): fast})
    assert "40.0 tok/s, τ 1.00" in lines[0]
    assert "60.0 tok/s, τ 1.90, 1.50x, same tokens as" in lines[1] and lines[1].endswith("yes")
