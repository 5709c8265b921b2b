"""engine.yaml validation: every missing or malformed field the runtime reads is one `error:` line naming its path."""

from __future__ import annotations

import shutil

import pytest
import yaml

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.integrity import file_sha256
from specbuild.runtime.manifest import load_manifest, validate_manifest
from tests.cli.test_cli import assert_one_line_error, invoke

pytestmark = pytest.mark.xdist_group("tiny")

SHAPE = "qwen2_bias"
DELETE = object()


def copy_engine(tiny_engines, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny_engines[SHAPE], dst)
    return dst


def read_manifest(engine):
    return yaml.safe_load((engine / ef.ENGINE_MANIFEST).read_text())


def write_manifest(engine, manifest):
    (engine / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))


def mutate(manifest, path: tuple, value):
    node = manifest
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def test_build_records_size_and_sha256_of_every_engine_file(tiny_engines):
    engine = tiny_engines[SHAPE]
    manifest = load_manifest(engine)
    files = sorted(p.name for p in engine.iterdir() if p.name != ef.ENGINE_MANIFEST)
    assert files == sorted(manifest["checksums"]) and ef.ENGINE_WEIGHTS in files
    for name, record in manifest["checksums"].items():
        assert record == {"size": (engine / name).stat().st_size, "sha256": file_sha256(engine / name)}


REMOVED = [
    "format",
    "format_version",
    "speculative_mode",
    "dtype",
    "model",
    "model.vocab_size",
    "model.num_layers",
    "model.num_kv_heads",
    "model.head_dim",
    "limits",
    "limits.max_seq_len",
    "limits.max_new_tokens_per_step",
    "tree",
    "tree.choices",
    "tree.size",
    "tree.depth",
    "graphs",
    "graphs.1.io",
    "graphs.1.io.inputs",
    "graphs.1.io.outputs",
    "graphs.1.file",
    "graphs.1.kv_cache",
    "graphs.0.backend",
    "graphs.0.weights",
    "files",
    "checksums",
    "checksums.model.onnx.size",
    "checksums.model.onnx.sha256",
]


def _split(field: str) -> tuple:
    if field.startswith("checksums.") and field.count(".") > 1:  # file names hold dots
        name, key = field.removeprefix("checksums.").rsplit(".", 1)
        return ("checksums", name, key)
    return tuple(int(p) if p.isdigit() else p for p in field.split("."))


def _shown(path: tuple) -> str:
    """The validator's spelling of a field path: list items as [i], mapping keys joined by dots."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _needle(path: tuple) -> str:
    if path[0] == "checksums" and len(path) == 3:
        return f"field checksums[{path[1]}].{path[2]} is missing"
    return f"field {_shown(path)} is missing"


@pytest.mark.parametrize("field", REMOVED)
def test_removed_field_is_one_error_line_naming_it(tiny_engines, tmp_path, field):
    engine = copy_engine(tiny_engines, tmp_path)
    manifest = read_manifest(engine)
    path = _split(field)
    mutate(manifest, path, DELETE)
    write_manifest(engine, manifest)
    needle = _needle(path)
    assert_one_line_error(invoke("inspect", engine), str(engine / ef.ENGINE_MANIFEST), needle)
    assert_one_line_error(invoke("run", "--engine-dir", engine, "--input-ids", "1,2"), needle)
    if field == "checksums":  # an engine built before file records: told to rebuild
        assert_one_line_error(invoke("inspect", engine), "rebuild the engine")


MALFORMED = [
    (("format",), "other-engine", "not a specbuild engine manifest"),
    (("format_version",), "1", "field format_version must be an integer"),
    (("dtype",), "int4", "field dtype must be one of float32, float16"),
    (("speculative_mode",), "", "field speculative_mode must be a non-empty string"),
    (("model",), [1, 2], "field model must be a mapping"),
    (("model", "vocab_size"), "97", "field model.vocab_size must be an integer >= 1"),
    (("model", "num_layers"), 0, "field model.num_layers must be an integer >= 1"),
    (("model", "head_dim"), 16.5, "field model.head_dim must be an integer >= 1"),
    (("model", "num_kv_heads"), None, "field model.num_kv_heads is null"),
    (("model", "eos_token_ids"), [2, -1], "field model.eos_token_ids[1] must be an integer >= 0"),
    (("limits", "max_seq_len"), 1, "field limits.max_seq_len must be an integer >= 2"),
    (("limits", "max_new_tokens_per_step"), True, "field limits.max_new_tokens_per_step must be an integer"),
    (("tree", "choices"), "abc", "field tree.choices must be a list of choices"),
    (("tree", "choices"), [[0, -1]], "field tree.choices must be a list of choices"),
    (("tree", "dynamic"), "yes", "field tree.dynamic must be true or false"),
    (("states",), [{"name": "x", "dtype": "float32"}], "field states[0].shape is missing"),
    (("states",), [{"name": "x", "shape": [1, "Q"], "dtype": "float32"}], "field states[0].shape must be"),
    (("states",), [{"name": "x", "shape": [1, "C"], "dtype": "float32", "grow_axis": 5}], "states[0].grow_axis 5"),
    (("states",), [{"name": "x", "shape": [1], "dtype": "int4"}], "field states[0].dtype must be one of"),
    (
        ("graphs", 1, "io", "outputs"),
        [{"name": "new_kv", "dtype": "float", "shape": [1]}],
        "graphs[1].io.outputs lacks",
    ),
    (
        ("graphs", 0, "io", "outputs"),
        [{"name": "accepted_tokens", "dtype": "int64", "shape": [1]}],
        "lacks num_accepted",
    ),
    (
        ("graphs", 1, "io", "inputs"),
        [{"name": "input_ids", "shape": [1]}],
        "field graphs[1].io.inputs[0].dtype is missing",
    ),
    (("graphs", 1, "file"), "../model.onnx", "field graphs[1].file must be a file name inside the engine directory"),
    (
        ("graphs", 1, "file"),
        "other.onnx",
        "field graphs[1].file names other.onnx, which field checksums does not record",
    ),
    (("graphs", 0, "kv_cache"), "paged", "field graphs[0].kv_cache must be one of stacked, shared"),
    (("graphs", 1, "backend"), "cuda", "field graphs[1].backend must be one of onnxruntime, tensorrt"),
    (("graphs", 1, "weights"), "int3", "field graphs[1].weights must be one of fp32, fp16, int8, int4"),
    (("graphs",), [], "field graphs must have at least 1 item"),
    (("files", "tokenizer"), "tokenizer.json", "field files.tokenizer names tokenizer.json"),
    (("checksums",), {}, "field checksums must be a mapping"),
    (("checksums", "model.onnx", "sha256"), "xyz", "field checksums[model.onnx].sha256 must be 64 hex digits"),
    (("checksums", "model.onnx", "size"), -1, "field checksums[model.onnx].size must be an integer >= 0"),
    (("typical_acceptance",), "0.1", "field typical_acceptance must be a list of two numbers"),
    (("validation",), {"max_abs_diff": "small"}, "field validation must be a mapping with numbers"),
    (("chat_template",), 5, "field chat_template must be a string"),
    (("mode",), [1], "field mode must be a mapping"),
    (("lossy_reason",), 3, "field lossy_reason must be a string"),
    (("graphs", 0, "quantization"), [4], "field graphs[0].quantization must be a mapping"),
    (
        ("graphs", 0, "quantization"),
        {"bits": 4, "accuracy_level": "4"},
        "field graphs[0].quantization.accuracy_level must be 1 (float32 activations) or 4 (int8 activations)",
    ),
]


@pytest.mark.parametrize("path,value,needle", MALFORMED, ids=[f"{_shown(m[0])}={m[1]!r}" for m in MALFORMED])
def test_malformed_field_is_one_error_line_naming_it(tiny_engines, tmp_path, path, value, needle):
    engine = copy_engine(tiny_engines, tmp_path)
    manifest = read_manifest(engine)
    mutate(manifest, path, value)
    write_manifest(engine, manifest)
    assert_one_line_error(invoke("inspect", engine), str(engine / ef.ENGINE_MANIFEST), needle)
    with pytest.raises(SpecbuildError, match="engine.yaml: "):
        load_manifest(engine)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "format: [unclosed\n", "", "\xff\xfe garbage"])
def test_manifest_that_is_not_a_mapping(tiny_engines, tmp_path, text):
    engine = copy_engine(tiny_engines, tmp_path)
    (engine / ef.ENGINE_MANIFEST).write_bytes(text.encode("latin-1"))
    assert_one_line_error(invoke("inspect", engine), str(engine / ef.ENGINE_MANIFEST))


def test_unknown_fields_are_ignored_and_dynamic_trees_need_no_choices(tiny_engines):
    manifest = yaml.safe_load((tiny_engines[SHAPE] / ef.ENGINE_MANIFEST).read_text())
    manifest["added_by_a_later_version"] = {"x": 1}
    manifest["tree"] = {"dynamic": True}
    assert validate_manifest(manifest, "engine.yaml") is manifest


def test_bad_accuracy_level_is_named_at_load_not_reported_as_damage(tiny_engines, tmp_path):
    """The runtime reads graphs[].quantization.accuracy_level to load the graph: a bad value names the field."""
    from specbuild.runtime.engine import Engine

    engine = copy_engine(tiny_engines, tmp_path)
    manifest = read_manifest(engine)
    manifest["graphs"][0]["quantization"] = {"bits": 4, "accuracy_level": 2}
    write_manifest(engine, manifest)
    with pytest.raises(SpecbuildError, match=r"field graphs\[0\]\.quantization\.accuracy_level must be 1") as err:
        Engine(engine, threads=1)
    assert "damaged" not in str(err.value) and "\n" not in str(err.value)
