"""Engine file integrity: loading checks the recorded sizes, `inspect --verify` the sha256 hashes; a damaged engine
file is one `error:` line naming it, never a traceback and never silent garbage with exit 0."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine
from specbuild.runtime.integrity import record_files
from tests.cli.test_cli import assert_one_line_error, invoke

pytestmark = pytest.mark.xdist_group("tiny")

SHAPE = "qwen2_bias"  # vocab 89


def copy_engine(tiny_engines, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(tiny_engines[SHAPE], dst)
    return dst


def flip_bytes(path, offset: int = 0, count: int = 64):
    """Same size, other bytes."""
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path, keep: float = 0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def run_ids(engine):
    return invoke("run", "--engine-dir", engine, "--input-ids", "1,5,9", "--max-new-tokens", 3)


def test_verify_passes_on_an_intact_engine(tiny_engines):
    engine = tiny_engines[SHAPE]
    res = invoke("inspect", engine, "--verify")
    assert res.exit_code == 0, res.output
    assert "OK" in res.stdout and ef.ENGINE_WEIGHTS in res.stdout
    info = json.loads(invoke("inspect", engine, "--verify", "--json").stdout)
    assert info["verified"] == sorted(info["checksums"]) == [ef.ENGINE_ONNX, ef.ENGINE_ORT_ONNX, ef.ENGINE_WEIGHTS]
    assert json.loads(invoke("inspect", engine, "--json").stdout)["verified"] is None


def test_same_size_replaced_weights_load_but_fail_verify(tiny_engines, tmp_path):
    engine = copy_engine(tiny_engines, tmp_path)
    flip_bytes(engine / ef.ENGINE_WEIGHTS, offset=1000)
    # sizes match: loading (a stat per file) cannot tell; --verify reads the bytes
    Engine(engine, threads=1)
    assert invoke("inspect", engine).exit_code == 0
    res = invoke("inspect", engine, "--verify")
    assert_one_line_error(res, str(engine / ef.ENGINE_WEIGHTS), "sha256", "rebuild")


@pytest.mark.parametrize("name", [ef.ENGINE_WEIGHTS, ef.ENGINE_ORT_ONNX, ef.ENGINE_ONNX])
def test_truncated_engine_file_is_refused_on_load(tiny_engines, tmp_path, name):
    engine = copy_engine(tiny_engines, tmp_path)
    truncate(engine / name)
    with pytest.raises(SpecbuildError, match=f"{name}: .* bytes, but engine.yaml records"):
        Engine(engine, threads=1)
    assert_one_line_error(run_ids(engine), str(engine / name), "truncated")
    assert_one_line_error(invoke("inspect", engine), str(engine / name))
    assert_one_line_error(invoke("inspect", engine, "--verify"), str(engine / name))


@pytest.mark.parametrize("name", [ef.ENGINE_WEIGHTS, ef.ENGINE_ORT_ONNX, ef.ENGINE_ONNX])
def test_deleted_engine_file_is_refused_on_load(tiny_engines, tmp_path, name):
    engine = copy_engine(tiny_engines, tmp_path)
    (engine / name).unlink()
    assert_one_line_error(run_ids(engine), str(engine / name), "missing")


def test_corrupt_graph_with_matching_records_is_one_line(tiny_engines, tmp_path):
    """Even when engine.yaml was re-recorded over a damaged graph, ONNX Runtime's failure is one line naming it."""
    engine = copy_engine(tiny_engines, tmp_path)
    flip_bytes(engine / ef.ENGINE_ORT_ONNX, offset=0, count=4096)
    manifest = yaml.safe_load((engine / ef.ENGINE_MANIFEST).read_text())
    manifest["checksums"] = record_files(engine)
    (engine / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    with pytest.raises(SpecbuildError, match="model.ort.onnx: cannot load the engine graph"):
        Engine(engine, threads=1)
    assert_one_line_error(run_ids(engine), str(engine / ef.ENGINE_ORT_ONNX), "cannot load")


@pytest.fixture
def engine_with_tokenizer(tiny_engines, tmp_path):
    """A copy of the tiny engine with a word-level tokenizer.json (ids < 89) recorded in engine.yaml."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    engine = copy_engine(tiny_engines, tmp_path)
    vocab = {f"w{i}": i for i in range(89)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(engine / ef.TOKENIZER_FILE))
    manifest = yaml.safe_load((engine / ef.ENGINE_MANIFEST).read_text())
    manifest["files"]["tokenizer"] = ef.TOKENIZER_FILE
    manifest["checksums"] = record_files(engine)
    (engine / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    return engine


def test_tokenizer_deleted_or_damaged(engine_with_tokenizer):
    engine = engine_with_tokenizer
    args = ("run", "--engine-dir", engine, "--prompt", "w5 w9 w13", "--max-new-tokens", 3)
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert invoke("inspect", engine, "--verify").exit_code == 0
    flip_bytes(engine / ef.TOKENIZER_FILE, count=8)  # same size, not JSON any more
    assert_one_line_error(invoke(*args), str(engine / ef.TOKENIZER_FILE), "cannot read the tokenizer")
    assert_one_line_error(invoke("inspect", engine, "--verify"), str(engine / ef.TOKENIZER_FILE), "sha256")
    (engine / ef.TOKENIZER_FILE).unlink()
    assert_one_line_error(invoke(*args), str(engine / ef.TOKENIZER_FILE), "missing")


def test_verify_on_a_checkpoint_is_one_line(tiny_checkpoints):
    assert_one_line_error(invoke("inspect", tiny_checkpoints[SHAPE], "--verify"), "--verify")
