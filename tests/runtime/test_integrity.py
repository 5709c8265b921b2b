"""Engine file integrity: loading checks the recorded sizes and, once per file identity, the sha256 hashes;
`inspect --verify` checks the hashes again. A damaged engine file is one `error:` line naming it, never a traceback
and never silent garbage with exit 0."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine
from specbuild.runtime.integrity import record_files, verify_once
from tests.cli.test_cli import assert_one_line_error, invoke
from tests.helpers import ORT_ONLY, quiet

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


def random_bytes(path, seed: int = 0):
    """What the issue tried: the file replaced by random bytes of the same size."""
    import numpy as np

    path.write_bytes(np.random.default_rng(seed).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("damage", [flip_bytes, random_bytes])
def test_same_size_replaced_weights_are_refused_on_load(tiny_engines, tmp_path, damage):
    engine = copy_engine(tiny_engines, tmp_path)
    damage(engine / ef.ENGINE_WEIGHTS)
    with pytest.raises(SpecbuildError, match="weights.bin: sha256 .* differs"):
        Engine(engine, threads=1)
    assert_one_line_error(run_ids(engine), str(engine / ef.ENGINE_WEIGHTS), "sha256", "rebuild")
    assert invoke("inspect", engine).exit_code == 0  # describes it (reads metadata only) ...
    res = invoke("inspect", engine, "--verify")  # ... and --verify names the damage
    assert_one_line_error(res, str(engine / ef.ENGINE_WEIGHTS), "sha256", "rebuild")


def test_hashes_are_checked_once_per_file_identity(tiny_engines, tmp_path, monkeypatch):
    """An unchanged engine is hashed on its first load only; a file written again (new mtime/ctime) is hashed again,
    and damage done after a verified load is still caught; with the cache off, every load hashes."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "cache"))
    engine = copy_engine(tiny_engines, tmp_path)
    records = yaml.safe_load((engine / ef.ENGINE_MANIFEST).read_text())["checksums"]
    total = sum(r["size"] for r in records.values())
    assert verify_once(engine, records) == total
    assert verify_once(engine, records) == 0
    Engine(engine, threads=1)  # loads with the kept verification
    data = (engine / ef.ENGINE_WEIGHTS).read_bytes()
    (engine / ef.ENGINE_WEIGHTS).write_bytes(data)  # same bytes, a new identity: hashed again, and fine
    assert verify_once(engine, records) == records[ef.ENGINE_WEIGHTS]["size"]
    flip_bytes(engine / ef.ENGINE_WEIGHTS, offset=1000)
    with pytest.raises(SpecbuildError, match="sha256"):
        Engine(engine, threads=1)
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    (engine / ef.ENGINE_WEIGHTS).write_bytes(data)
    assert verify_once(engine, records) == total == verify_once(engine, records)


def test_the_building_machine_does_not_hash_its_engine_again(tiny_checkpoints, tmp_path, monkeypatch):
    """The build hashed every file it wrote: those identities count as verified, so the engine's first load there
    hashes nothing; a file changed afterwards is hashed (and refused) all the same."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "cache"))
    options = BuildOptions(backends=ORT_ONLY)
    engine = build_engine(tiny_checkpoints["llama_gqa_llama3rope"], tmp_path / "engine", options, log=quiet)
    records = yaml.safe_load((engine / ef.ENGINE_MANIFEST).read_text())["checksums"]
    assert verify_once(engine, records) == 0
    flip_bytes(engine / ef.ENGINE_WEIGHTS, offset=1000)
    with pytest.raises(SpecbuildError, match="sha256"):
        Engine(engine, threads=1)


def test_a_digest_taken_as_a_file_was_written_counts_only_while_it_is_unchanged(tmp_path):
    """remember_written: record_files takes the sha256 the writer took (a rename keeps it), and reads the file again
    once it was written to or replaced."""
    from specbuild.runtime import integrity

    path = tmp_path / "weights.data"
    path.write_bytes(b"x" * 5000)
    integrity.remember_written(path, "0" * 64)  # what the writer says it took
    path.rename(tmp_path / "weights.bin")
    assert record_files(tmp_path)["weights.bin"]["sha256"] == "0" * 64
    renamed = tmp_path / "weights.bin"
    flip_bytes(renamed, offset=10)  # same size; its modification time is a later one (set: a coarse clock may not)
    stat = renamed.stat()
    os.utime(renamed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**7))
    assert record_files(tmp_path)["weights.bin"]["sha256"] == integrity.file_sha256(renamed)
    integrity.remember_written(renamed, "1" * 64)
    with open(renamed, "ab") as fh:  # another size
        fh.write(b"y")
    assert record_files(tmp_path)["weights.bin"]["sha256"] == integrity.file_sha256(renamed)


def test_raised_max_seq_len_is_refused_on_load(tiny_engines, tmp_path):
    """limits.max_seq_len raised past what the graph was built for: one line at load, not an ONNX Runtime traceback
    in the middle of generation."""
    engine = copy_engine(tiny_engines, tmp_path)
    manifest = yaml.safe_load((engine / ef.ENGINE_MANIFEST).read_text())
    built = manifest["limits"]["max_seq_len"]
    manifest["limits"]["max_seq_len"] = built * 4
    (engine / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    assert_one_line_error(run_ids(engine), "limits.max_seq_len", str(built * 4), f"<= {built}")
    manifest["limits"]["max_seq_len"] = built // 2  # lowering it is the user's right
    (engine / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    assert Engine(engine, threads=1).max_seq_len == built // 2
    for graph in ("onnxruntime", "tensorrt"):  # the portable graph: the model's max_position_embeddings
        manifest["limits"]["max_seq_len"] = 10**6
        (engine / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
        with pytest.raises(SpecbuildError, match="limits.max_seq_len 1000000 exceeds"):
            Engine(engine, threads=1, graph=graph)


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
    assert_one_line_error(invoke(*args), str(engine / ef.TOKENIZER_FILE), "sha256")
    assert_one_line_error(invoke("inspect", engine, "--verify"), str(engine / ef.TOKENIZER_FILE), "sha256")
    manifest = yaml.safe_load((engine / ef.ENGINE_MANIFEST).read_text())
    manifest["checksums"] = record_files(engine)  # recorded over the damage: the tokenizer itself fails, one line
    (engine / ef.ENGINE_MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False))
    assert_one_line_error(invoke(*args), str(engine / ef.TOKENIZER_FILE), "cannot read the tokenizer")
    (engine / ef.TOKENIZER_FILE).unlink()
    assert_one_line_error(invoke(*args), str(engine / ef.TOKENIZER_FILE), "missing")


def test_verify_on_a_checkpoint_is_one_line(tiny_checkpoints):
    assert_one_line_error(invoke("inspect", tiny_checkpoints[SHAPE], "--verify"), "--verify")
