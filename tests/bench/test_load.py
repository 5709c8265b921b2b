"""`specbuild bench --concurrency`: the closed loop keeps C requests in flight and finishes every prompt, greedy and
seeded outputs are the same at every concurrency, the report holds its fields and renders, and a bad --concurrency
is one line. (The peers under load: tests/bench/peers/.)"""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from specbuild.bench.load import SchedulerLoad, closed_loop, median_round, parse_concurrency, run_load
from specbuild.bench.load_render import render_load
from specbuild.bench.results import Finished
from specbuild.cli.main import cli
from specbuild.errors import SpecbuildError
from tests.helpers import ORT_ONLY, quiet
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("bench_load")

_rng = np.random.default_rng(1)
PROMPTS = [[int(x) for x in _rng.integers(1, 90, size=int(_rng.integers(3, 20)))] for _ in range(7)]
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def load_engines(tiny_checkpoints, tmp_path_factory):
    """A tiny fp32 `none` and `ngram` engine with 4 KV slots."""
    from specbuild.builder.build import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("bench_load")
    ckpt = tiny_checkpoints["llama_gqa_llama3rope"]
    common = dict(backends=ORT_ONLY, max_seq_len=64, max_batch_size=4)
    return {
        "none": build_engine(ckpt, root / "none", BuildOptions(**common), log=quiet),
        "ngram": build_engine(
            ckpt, root / "ngram", BuildOptions(speculative_mode="ngram", num_draft_tokens=3, **common), log=quiet
        ),
    }


class CountingTarget:
    """A load target whose requests take `len(ids) % 3 + 1` steps; it records how many were in flight."""

    def __init__(self):
        self.live, self.most, self.submitted = [], 0, 0

    def submit(self, ids, sampling):
        request = {"ids": ids, "left": len(ids) % 3 + 1}
        self.live.append(request)
        self.submitted += 1
        self.most = max(self.most, len(self.live))
        return request

    def step(self):
        for request in self.live:
            request["left"] -= 1
        return bool(self.live)

    def finished(self, request):
        if request["left"] > 0:
            return None
        self.live.remove(request)
        return Finished(list(request["ids"]), 0.1, 0.2, 0.3)


@pytest.mark.parametrize("concurrency", [1, 3, 10])
def test_the_closed_loop_keeps_c_in_flight_and_finishes_every_prompt(concurrency):
    target = CountingTarget()
    run = closed_loop(target, PROMPTS, concurrency)
    assert target.submitted == len(PROMPTS) and not target.live
    assert run.most_in_flight == target.most == min(concurrency, len(PROMPTS))
    assert [r.output_ids for r in run.done] == PROMPTS  # in prompt order
    assert run.wall_s > 0 and run.steps >= len(PROMPTS) / concurrency


def test_a_target_that_stops_early_is_an_error():
    target = CountingTarget()
    target.step = lambda: False
    with pytest.raises(SpecbuildError, match="stopped with 1 requests unfinished"):
        closed_loop(target, PROMPTS[:1], 1)


def test_concurrency_lists_are_parsed_or_refused_in_one_line():
    assert parse_concurrency("16, 1,4,4") == [1, 4, 16]
    for bad in ("", "0", "1,,4", "-2", "4.5", "a"):
        with pytest.raises(SpecbuildError, match="--concurrency must be comma-separated integers >= 1"):
            parse_concurrency(bad)


@full("a load benchmark on two engines")
def test_greedy_outputs_are_the_same_at_every_concurrency_and_the_report_has_its_fields(load_engines):
    from specbuild.runtime.engine import Engine

    engines = [Engine(load_engines[m]) for m in ("none", "ngram")]
    labels = ["none", "ngram"]
    results = run_load(engines, labels, PROMPTS, [1, 3, 8], MAX_NEW_TOKENS, log=quiet)
    assert list(results) == ["1", "3", "8"]
    for c, res in results.items():
        for label, row in res["engines"].items():
            assert row["requests"] == len(PROMPTS) and row["matches_baseline"] == len(PROMPTS), (c, label)
            assert row["most_in_flight"] == min(int(c), len(PROMPTS)) and row["slots"] == min(int(c), 4)
            assert row["tokens"] <= len(PROMPTS) * MAX_NEW_TOKENS and row["tokens_per_s"] > 0
            assert row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["itl_p50_ms"] <= row["itl_p99_ms"]
            assert row["latency_p50_ms"] >= row["ttft_p50_ms"] and row["steps"] > 0 and row["rss_mib"] > 0
            assert row["tau"] >= 1 and 0 <= row["drafted_share"] <= 1 and row["speedup"] > 0
            assert 0 < row["drafted_steps"] + row["plain_steps"] <= row["steps"]  # the warm-up is not counted
        none = res["engines"]["none"]
        assert none["tau"] == 1 and none["drafted_share"] == 0 and none["speedup"] == 1
        assert none["ceiling_tokens_per_s"] > 0 and none["ceiling_share"] > 0
        assert "ceiling_tokens_per_s" not in res["engines"]["ngram"] and res["engines"]["ngram"]["vs_peer"] is None
    assert results["1"]["engines"]["ngram"]["scaling"] == 1


def _invoke(*args):
    return CliRunner().invoke(cli, ["bench", *map(str, args)], catch_exceptions=False)


@pytest.mark.parametrize("value", ["0", "1,x", "", "2,-4"])
def test_a_bad_concurrency_is_one_line_before_any_engine_loads(tmp_path, value):
    res = _invoke("--engine-dir", tmp_path / "missing", "--concurrency", value)
    assert res.exit_code == 1
    want = f"error: --concurrency must be comma-separated integers >= 1 (e.g. 1,4,16), got {value!r}"
    assert res.output.strip() == want


def test_concurrency_refuses_the_one_at_a_time_peers(tmp_path):
    res = _invoke("--engine-dir", tmp_path, "--concurrency", "1,4", "--context-sweep")
    assert res.exit_code == 1 and "belongs to the one-at-a-time benchmark" in res.output


@full("a load benchmark on two engines")
def test_bench_concurrency_end_to_end(load_engines, tmp_path, monkeypatch):
    """The CLI renders the load table and the cost curve and writes every number to --json-out."""
    import specbuild.bench.load as bench_load

    monkeypatch.setattr(bench_load, "interleaved_prompts", lambda engine, sets, n: PROMPTS[:n])
    out = tmp_path / "load.json"
    args = ["--engine-dir", load_engines["none"], "--engine-dir", load_engines["ngram"], "--num-prompts", 4]
    res = _invoke(*args, "--max-new-tokens", 4, "--concurrency", "4,1", "--repeats", 2, "--json-out", out)
    assert res.exit_code == 0, res.output
    for needle in ("closed loop: 4 requests", "TTFT ms p50/p99", "ITL ms p50/p99", "call cost", "ceiling", "4/4"):
        assert needle in res.output, needle
    report = json.loads(out.read_text())
    assert report["settings"]["concurrency"] == [1, 4] and list(report["load"]) == ["1", "4"]
    curve = report["engines"][0]["cost_curve"]
    assert [p["rows"] for p in curve["rows_curve"]] == [1, 2, 4, 8, 16, 32, 64] and curve["slots"] == 4
    assert report["engines"][0]["kv_mib_per_slot"] > 0 and report["baseline"].endswith("(none)")
    for res in report["load"].values():  # two rounds of each, in turns; the row is one of them, same outputs
        for row in res["engines"].values():
            assert len(row["rounds_tokens_per_s"]) == 2 and row["tokens_per_s"] in row["rounds_tokens_per_s"]
            assert row["rounds_same_outputs"] is True and row["matches_baseline"] == 4


def test_a_row_of_several_rounds_is_the_median_one():
    def runs():
        return [({"tokens_per_s": v, "steps": i}, [[i]]) for i, v in enumerate([150.0, 170.0, 140.0])]

    row, outs = median_round(runs())
    assert row["steps"] == 0 and outs == [[0]]  # 150 is the middle one
    assert row["rounds_tokens_per_s"] == [150.0, 170.0, 140.0] and row["rounds_same_outputs"] is False
    row, _ = median_round(runs()[:2])  # an even count: the lower middle one
    assert row["tokens_per_s"] == 150.0
    alone, _ = median_round(runs()[:1])
    assert "rounds_tokens_per_s" not in alone


def test_repeats_belong_to_the_load_benchmark(tmp_path):
    res = _invoke("--engine-dir", tmp_path, "--repeats", 3)
    assert res.exit_code == 1 and res.output.strip() == "error: --repeats belongs to the load benchmark (--concurrency)"


@full("a load benchmark on two engines")
def test_render_shows_peers_and_own_none(load_engines):
    from rich.console import Console

    row = dict(requests=2, tokens=8, tokens_per_s=10.0, steps=5, rss_mib=100.0, tau=1.5, drafted_share=0.5)
    row.update({f"{k}_p{q}_ms": 1.0 for k in ("ttft", "itl") for q in (50, 99)}, speedup=1.1, scaling=1.0)
    row.update(matches_baseline=1, own_none="int4 none", matches_own_none=2, vs_peer=0.8)
    peer = dict(row, tau=None, drafted_share=None, vs_peer=None)
    curve = {"slots": 1, "rows_curve": [dict(rows=r, ms=r, ms_per_row=1.0) for r in (1, 2)]}
    report = {
        "settings": dict(requests=2, prompt_sets=["humaneval"], max_new_tokens=4, concurrency=[2]),
        "baseline": "none",
        "engines": [dict(label="int4 ngram", kv_mib_per_slot=1.0, cost_curve=curve)],
        "load": {"2": {"engines": {"int4 ngram": row}, "peers": {"OpenVINO GenAI CB ov4": peer}}},
    }
    console = Console(record=True, width=260)
    render_load(report, console)
    text = console.export_text()
    assert "1/2 (own 2/2)" in text and "OpenVINO GenAI CB ov4" in text and "2.0 (1.00)" in text


def test_sampled_outputs_are_the_same_at_every_concurrency_and_equal_none(load_engines):
    """`bench --temperature`: request i is seeded with seed + i, so a sampled request gives the same tokens at every
    concurrency and in a speculative engine as in `none` (a seed does not depend on what was drafted or batched)."""
    from specbuild.runtime.engine import Engine, SamplingParams

    engines = [Engine(load_engines[m]) for m in ("none", "ngram")]
    sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
    results = run_load(engines, ["none", "ngram"], PROMPTS, [1, 3], MAX_NEW_TOKENS, log=quiet, sampling=sampling)
    for c, res in results.items():
        for label, row in res["engines"].items():
            assert row["matches_baseline"] == len(PROMPTS), (c, label)
    greedy = closed_loop(SchedulerLoad(engines[0], 3, MAX_NEW_TOKENS), PROMPTS, 3)
    sampled = closed_loop(SchedulerLoad(engines[0], 3, MAX_NEW_TOKENS), PROMPTS, 3, sampling)
    assert [r.output_ids for r in sampled.done] != [r.output_ids for r in greedy.done]
