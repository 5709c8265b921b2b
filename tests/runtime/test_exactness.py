"""What an int8-activation engine promises on the machine that runs it (runtime/exactness.py): the probe's verdict
decides the step padding, every engine of a build pads alike, and a speculative engine that cannot be exact here is
refused in one line or, with --allow-lossy, runs labelled lossy. Each branch is forced here so that every machine
covers all of them, whatever its own CPU does; the real branch of this machine runs too."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime import row_invariance as ri
from specbuild.runtime.drafter import Proposal
from specbuild.runtime.engine import Engine, SamplingParams
from specbuild.runtime.session import Session
from specbuild.tree import Tree
from tests.cli.test_cli import assert_one_line_error, invoke

pytestmark = pytest.mark.xdist_group("quantize")

PROMPTS = [[1, 5, 9, 3, 7, 5, 9, 3], [1, 4, 8, 4, 8, 4], [1, 11, 10, 6, 2, 8, 3, 11, 10]]


@pytest.fixture
def force_probe(monkeypatch, tmp_path):
    """force_probe(rows_from): the probe reports that every MatMulNBits needs `rows_from` rows (None: varies with
    the row count) and attention 2; a fresh cache keeps the forced verdict away from other tests."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "cache"))

    def force(rows_from):
        def probe(model, threads, accuracy_level, max_rows=ri.MAX_PROBE_ROWS):
            kernels = {name: (2 if name.startswith("GroupQueryAttention") else rows_from)
                       for name in ri._Collector(model).kernels}  # fmt: skip
            return ri.Verdict(kernels, "forced CPU (test)", 0.001)

        monkeypatch.setattr(ri, "probe_model", probe)

    return force


def generate(engine, ids, n=24):
    return engine.generate(input_ids=ids, max_new_tokens=n, sampling=SamplingParams()).output_ids


def test_this_machine(int8_engines):
    """Whatever this CPU does: an exact path exists (AVX-512: no padding; AVX2: calls padded to 2 rows, both
    measured) and the ngram engine reproduces its none engine; the engines of a build pad alike."""
    none, ngram = Engine(int8_engines["none"], threads=1), Engine(int8_engines["ngram"], threads=1)
    assert none.lossless and ngram.lossless
    assert none.min_rows == ngram.min_rows == ngram.exactness.probe.min_rows in (1, 2)
    assert ngram.exactness.probe.cpu == ri.cpu_description()
    for ids in PROMPTS:
        assert generate(ngram, ids) == generate(none, ids), ids


@pytest.mark.parametrize("rows_from", [1, 2])
def test_forced_exact_paths_pad_every_engine_alike(int8_engines, force_probe, rows_from):
    force_probe(rows_from)
    none, ngram = Engine(int8_engines["none"], threads=1), Engine(int8_engines["ngram"], threads=1)
    assert none.min_rows == ngram.min_rows == rows_from and ngram.lossless
    assert ("padded to 2 rows" in ngram.exactness.verified) == (rows_from == 2)
    if rows_from == 2:  # padding is exact on every CPU (rows of multi-row calls agree on both kinds measured)
        steps = []
        for ids in [*PROMPTS, [1]]:  # a one-token prompt: its prefill is padded too
            result = ngram.generate(input_ids=ids, max_new_tokens=24)
            assert result.output_ids == generate(none, ids), ids
            steps += result.accepted_per_step
        assert max(steps) > 1
        # up to the last position: the pad row of the last calls lands in the scratch slot after max_seq_len
        none.eos_ids = ngram.eos_ids = set()
        long = ngram.generate(input_ids=PROMPTS[0], max_new_tokens=500)
        assert long.stop_reason == "max_seq_len" and len(PROMPTS[0]) + len(long.output_ids) >= ngram.max_seq_len
        assert long.output_ids == generate(none, PROMPTS[0], 500)


def step_logits(engine, ids, proposal_tokens):
    """Logits of one verification call of a chain of proposal_tokens (root first) after prefilling ids."""
    session = Session(engine.layout, engine.backend, SamplingParams(), len(ids) + 8)
    session.prefill(ids)
    size = len(proposal_tokens)
    tree = Tree.from_choices([[0] * d for d in range(1, size)])
    return session.verify(Proposal.from_tree(proposal_tokens, tree)).outputs[ef.LOGITS][0]


def test_a_padded_one_token_call_gives_the_bits_of_a_longer_call(int8_engines):
    """The graph's step padding: at min_rows 2 a one-token call's logits equal, bit for bit, the first row of a call
    verifying that token and a draft after it (the whole network and the lm_head ran on two rows in both)."""
    engine = Engine(int8_engines["none"], threads=1)
    engine.layout = dataclasses.replace(engine.layout, min_rows=2, scratch_rows=1)
    for ids in PROMPTS:
        one = step_logits(engine, ids[:-1], [ids[-1]])
        two = step_logits(engine, ids[:-1], [ids[-1], 7])
        assert one.shape[0] == 1 and np.array_equal(one[0], two[0]), ids


def test_no_exact_path_refuses_speculation_in_one_line(int8_engines, force_probe):
    force_probe(None)
    with pytest.raises(SpecbuildError, match="engine.yaml says lossless, but on forced CPU"):
        Engine(int8_engines["ngram"], threads=1)
    args = ("run", "--engine-dir", int8_engines["ngram"], "--input-ids", "1,5,9", "--max-new-tokens", 4)
    assert_one_line_error(invoke(*args), "MatMulNBits", "--allow-lossy")
    res = invoke(*args, "--allow-lossy", "--json")
    assert res.exit_code == 0, res.output
    exactness = json.loads(res.stdout)["exactness"]
    assert exactness["lossless"] is False and "not exact on this CPU" in exactness["verified"]
    assert "LOSSY" in res.stderr
    lossy = Engine(int8_engines["ngram"], threads=1, allow_lossy=True)
    assert not lossy.lossless and lossy.min_rows == 1
    none = Engine(int8_engines["none"], threads=1)  # plain decoding is the model: it runs, unpadded
    assert none.lossless and none.min_rows == 1 and "plain decoding" in none.exactness.verified
    info = json.loads(invoke("inspect", int8_engines["ngram"], "--json").stdout)
    assert info["lossless"] is True and info["this_machine"]["lossless"] is False


def test_the_probe_covers_the_longest_call_of_the_engine(int8_engines, monkeypatch, tmp_path):
    """An engine whose calls hold more rows than the probe's default measures calls that long."""
    import yaml

    from specbuild.runtime import exactness

    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "cache"))
    seen = []
    real = ri.probe_model
    monkeypatch.setattr(
        ri, "probe_model", lambda model, t, a, max_rows: seen.append(max_rows) or real(model, t, a, max_rows)
    )
    engine_dir = int8_engines["ngram"]
    manifest = yaml.safe_load((engine_dir / ef.ENGINE_MANIFEST).read_text())
    graph = manifest["graphs"][0]
    exactness.decide(engine_dir, manifest, graph, ef.BACKEND_ONNXRUNTIME, 1, allow_lossy=True)
    manifest["limits"]["max_new_tokens_per_step"] = 25  # e.g. 24 drafts
    exactness.decide(engine_dir, manifest, graph, ef.BACKEND_ONNXRUNTIME, 1, allow_lossy=True)
    manifest["limits"]["max_batch_size"] = 1
    exactness.decide(engine_dir, manifest, graph, ef.BACKEND_ONNXRUNTIME, 1, allow_lossy=True)
    slots = 16  # the default --max-batch-size: a call holds every slot's tokens and attention pad row
    assert seen == [slots * (4 + 1), slots * (25 + 1), 25 + 1]


def test_forced_probe_needing_more_rows_than_the_graph_pads(int8_engines, force_probe):
    force_probe(3)
    with pytest.raises(SpecbuildError, match="cannot pad calls enough"):
        Engine(int8_engines["ngram"], threads=1)
