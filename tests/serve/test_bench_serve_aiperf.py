"""scripts/bench-serve.sh's driver end to end: AIPerf against real `specbuild serve` processes on the tiny engines.
Full tier: `scripts/test.sh --full` sets up AIPerf's own environment (scripts/setup-aiperf.sh) and names its aiperf in
SPECBUILD_AIPERF; run alone, set it yourself (e.g. SPECBUILD_AIPERF=.venv-aiperf/bin/aiperf)."""

from __future__ import annotations

import json
import os

import pytest

from specbuild.bench.serve.run import Settings, run_benchmark
from tests.tiers import full

AIPERF = os.environ.get("SPECBUILD_AIPERF")
pytestmark = [
    pytest.mark.xdist_group("serve"),
    full("AIPerf against real servers: minutes"),
    pytest.mark.skipif(not AIPERF, reason="needs AIPerf: scripts/test.sh --full sets SPECBUILD_AIPERF"),
]


def test_aiperf_measures_none_and_ngram_at_two_concurrencies(serve_engines, tmp_path):
    engines = [serve_engines["none"], serve_engines["ngram"]]
    settings = Settings(engines, [1, 2], requests=4, output_tokens=16, prompts="synthetic:16", out_dir=tmp_path,
                        aiperf=AIPERF, threads=1)  # fmt: skip
    report = run_benchmark(settings, log=lambda line: None)
    rows = report["rows"]
    assert [(r["engine"], r["concurrency"]) for r in rows] == [("none", 1), ("none", 2), ("ngram", 1), ("ngram", 2)]
    for row in rows:  # the tiny engines have no EOS token: every request runs to its max tokens
        assert row["requests"] == 4 and row["errors"] == 0 and row["output_tokens_mean"] == 16
        assert row["output_tokens_per_s"] > 0 and row["latency_ms"]["p50"] >= row["ttft_ms"]["p50"] > 0
        # a step's tokens (and on a fast machine a tiny engine's whole answer) may reach AIPerf in one read: the
        # inter-token latency is then 0, a correct measurement
        assert all(row["itl_ms"][stat] >= 0 for stat in ("avg", "p50", "p99"))
    assert rows[0]["acceptance_length"] is None  # `none` never drafts
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == json.loads(json.dumps(rows))
    assert len(report["commands"]) == 6 and "| ngram | ngram | 2 | 4 (0) |" in (tmp_path / "summary.md").read_text()
