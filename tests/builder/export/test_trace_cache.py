"""The trace cache: a build whose step module has the structure of an earlier one (same shape and mode settings,
other weights) reuses its exported graph and writes the same bytes as a build that exports afresh; another
structure never hits; what the fingerprint cannot hash is not cached."""

from pathlib import Path

import pytest
import torch

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.builder.export import trace_cache
from tests.helpers import ORT_ONLY
from tests.plugins.eagle_fixtures import write_eagle1_head
from tests.plugins.medusa_helpers import toy_model
from tests.tiers import full

SHAPE = "llama_gqa_llama3rope"
REUSED = "reusing the exported graph"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache of this test alone: nothing in memory, its own folder."""
    monkeypatch.setattr(trace_cache, "_MEMORY", {})
    monkeypatch.setenv(trace_cache.CACHE_ENV, str(tmp_path / "traces"))
    return tmp_path / "traces"


def _checkpoint(root: Path, seed: int, eagle: bool) -> Path:
    model = toy_model(SHAPE, root / "hf", vocab=12, seed=seed)
    heads = {}
    if eagle:
        write_eagle1_head(root / "head", model.config, seed=seed)
        heads = {"eagle": root / "head"}
    return convert_checkpoint(root / "hf", root / "ckpt", heads=heads, progress=False)


def _build(ckpt: Path, out: Path, **options) -> tuple[Path, list[str]]:
    lines = []
    build_engine(ckpt, out, BuildOptions(**options), log=lambda *a: lines.append(" ".join(map(str, a))))
    return out, lines


def _files(engine: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in engine.iterdir() if p.is_file() and p.name != "engine.yaml"}


def _same_engine_from_cache_and_afresh(tmp_path, monkeypatch, eagle: bool, graphs: int, **options) -> None:
    first, second = _checkpoint(tmp_path / "a", 1, eagle), _checkpoint(tmp_path / "b", 2, eagle)
    _, lines = _build(first, tmp_path / "e-first", **options)
    assert not any(REUSED in line for line in lines)
    cached, lines = _build(second, tmp_path / "e-cached", **options)
    assert sum(REUSED in line for line in lines) == graphs
    monkeypatch.setattr(trace_cache, "_MEMORY", {})
    monkeypatch.delenv(trace_cache.CACHE_ENV)
    fresh, lines = _build(second, tmp_path / "e-fresh", **options)
    assert not any(REUSED in line for line in lines)
    assert _files(cached) == _files(fresh)  # graphs and weights, byte for byte (the build validated both)
    assert _files(cached)["weights.bin"] != _files(tmp_path / "e-first")["weights.bin"]  # the second's own weights


@full("three builds (the fast tier's builds share the run's trace cache; this proves the bytes equal)")
def test_a_build_of_the_same_structure_reuses_the_trace_and_writes_the_same_bytes(tmp_path, monkeypatch, empty_cache):
    _same_engine_from_cache_and_afresh(tmp_path, monkeypatch, eagle=False, graphs=1, backends=ORT_ONLY)
    assert len(list(empty_cache.glob("*.onnx"))) == 1


@full("both graphs of an engine-drafted mode (its drafting behind an If, the tree's buffers) from the cache")
def test_an_engine_drafted_mode_from_the_cache_equals_its_fresh_build(tmp_path, monkeypatch, empty_cache):
    tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    _same_engine_from_cache_and_afresh(tmp_path, monkeypatch, eagle=True, graphs=2, speculative_mode="eagle", tree=tree)


@full("two more builds, each of another structure")
@pytest.mark.parametrize("other", [dict(num_draft_tokens=4), dict(max_seq_len=64)])
def test_another_structure_never_hits(tmp_path, empty_cache, other):
    ckpt = _checkpoint(tmp_path / "a", 1, eagle=False)
    _build(ckpt, tmp_path / "e1", backends=ORT_ONLY, speculative_mode="ngram", num_draft_tokens=3)
    options = {"num_draft_tokens": 3, **other}
    _, lines = _build(ckpt, tmp_path / "e2", backends=ORT_ONLY, speculative_mode="ngram", **options)
    assert not any(REUSED in line for line in lines)


def test_the_fingerprint_follows_attributes_and_refuses_what_it_cannot_hash():
    class Step(torch.nn.Module):
        def __init__(self, depth, table):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.depth, self.table = depth, table

    args = (torch.zeros(1, 2),)
    key = trace_cache.fingerprint(Step(2, [1, 2]), args, ())
    assert trace_cache.fingerprint(Step(2, [1, 2]), args, ()) == key  # other weights, same structure
    assert trace_cache.fingerprint(Step(3, [1, 2]), args, ()) != key
    assert trace_cache.fingerprint(Step(2, [1, 3]), args, ()) != key
    assert trace_cache.fingerprint(Step(2, [1, 2]), (torch.zeros(1, 3),), ()) != key  # example input shape
    wide = Step(2, [1, 2])
    wide.lin = torch.nn.Linear(2, 3)
    assert trace_cache.fingerprint(wide, args, ()) != key
    constant = Step(2, torch.tensor([1, 2]))  # a plain tensor attribute may be baked in: its values count
    assert trace_cache.fingerprint(constant, args, ()) != trace_cache.fingerprint(
        Step(2, torch.tensor([1, 3])), args, ()
    )
    listed = Step(2, [1, 2])
    listed.layers = [listed.lin]  # a list of its own modules (EAGLE-3's draft layers): by their paths
    assert trace_cache.fingerprint(listed, args, ()) == trace_cache.fingerprint(listed, args, ())
    for value in (object(), lambda x: x, [torch.nn.Linear(2, 2)]):  # a module outside the step: not hashed
        with pytest.raises(trace_cache.Uncacheable):
            trace_cache.fingerprint(Step(2, value), args, ())
