"""The soak (specbuild/serve/soak.py) for 60 seconds on the ngram engine, and its checks failing when they should."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specbuild.serve import soak
from tests.serve.conftest import REPO
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("serve")


@full("a minute of load on a server")
def test_a_60_second_soak_passes(serve_engines, tmp_path):
    report = tmp_path / "soak.md"
    command = [sys.executable, "-m", "specbuild.serve.soak", "--engine-dir", str(serve_engines["ngram"])]
    command += ["--duration", "60", "--max-batch-size", "4", "--threads", "1", "--report", str(report)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECBUILD_SOAK_LOG": str(tmp_path / "server.log")}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    text = report.read_text()
    assert "PASS" in text and "failures: 0" in text
    assert "errors by status: {400:" in text  # the bad requests were sent and refused


def test_rss_growing_after_the_warm_up_fails():
    flat = [(t, 100.0 + (5 if t < 10 else 0), 0.0, 50.0) for t in range(0, 60, 2)]
    assert soak.check_rss(flat, 10)[2] is None
    growing = [(t, 100.0 + (t if t >= 10 else 0), 0.0, 50.0) for t in range(0, 60, 2)]
    assert "RSS less the KV cache grew from 110 MB to 158 MB" in soak.check_rss(growing, 10)[2]


def test_rss_settling_at_the_allocators_high_water_mark_passes_and_a_leak_past_it_fails():
    # run BB's shape: RSS less the KV cache rose for 4 of 10 minutes (the arena reaching the largest calls), then flat
    settling = [(t, 700.0 + min(t, 240) * 0.8, 0.0, 50.0) for t in range(0, 600, 2)]
    assert soak.check_rss(settling, 300) == (892.0, 892.0, None)
    # a leak: 10 MB a minute throughout sets new highs after the warm-up
    leaking = [(t, 700.0 + t / 6, 0.0, 50.0) for t in range(0, 600, 2)]
    assert "grew from 750 MB to 800 MB after the warm-up (allowed 24)" in soak.check_rss(leaking, 300)[2]


def test_rss_growing_with_the_kv_caches_written_pages_passes_and_a_kv_cache_over_its_bound_fails():
    # slots holding longer sequences than before: the KV cache's pages, under their bound, are not a leak
    kv_growth = [(t, 100.0 + t, 10.0 + t, 200.0) for t in range(0, 60, 2)]
    assert soak.check_rss(kv_growth, 10) == (90.0, 90.0, None)
    # growth beyond the KV cache's is still found
    beyond = [(t, 100.0 + 2 * t, 10.0 + t, 200.0) for t in range(0, 60, 2)]
    assert "RSS less the KV cache grew" in soak.check_rss(beyond, 10)[2]
    over = [(t, 100.0, 10.0 + 5 * t, 200.0) for t in range(0, 60, 2)]
    assert soak.check_rss(over, 10)[2] == "the KV cache held 210 MB at 40 s, over its bound 200"
    text = "specbuild:kv_cache_bytes 2097152.0\nspecbuild:kv_cache_bound_bytes 4194304.0\n"
    assert soak.kv_memory(text) == (2097152.0, 4194304.0)


def test_metrics_that_do_not_add_up_fail(tmp_path):
    run = soak.Soak("m", 4, 0)
    run.tally.sent = 10
    metrics = (
        'specbuild:request_success_total{finished_reason="length"} 7.0\n'
        'specbuild:request_errors_total{status="400"} 2.0\n'
    )
    args = type("Args", (), {"engine_dir": "e", "duration": 1.0, "seed": 0})()
    text, passed = soak.report(run, [(0, 100.0, 1.0, 9.0), (2, 100.0, 1.0, 9.0)], metrics, args, 1.0, healthy=True)
    assert not passed and "counts 9 requests" in text
    run.tally.failures.clear()
    text, passed = soak.report(
        run,
        [(0, 100.0, 1.0, 9.0), (2, 100.0, 1.0, 9.0)],
        metrics + "specbuild:request_cancelled_total 1.0\n",
        args,
        1.0,
        True,
    )
    assert passed, text


def test_learnt_memory_over_its_bound_fails_and_modes_that_learn_nothing_say_nothing():
    assert soak.check_learnt([(0.0, 0.0, 0.0), (30.0, 0.0, 0.0)]) == (None, None)
    line, failure = soak.check_learnt([(0.0, 1e6, 5e6), (30.0, 4e6, 5e6), (90.0, 4.5e6, 5e6)])
    assert failure is None and "at most 4.5 MB (bound 5.0 MB), by minute (MB): 0: 1.0, 1: 4.5" in line
    line, failure = soak.check_learnt([(0.0, 1e6, 5e6), (30.0, 6e6, 5e6)])
    assert failure == "the drafters' learnt memory was 6.0 MB at 30 s, over its bound 5.0"
    text = "specbuild:draft_memory_bytes 123.0\nspecbuild:draft_memory_bound_bytes 456.0\n"
    assert soak.learnt_memory(text) == (123.0, 456.0)
