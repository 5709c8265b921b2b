"""`specbuild bench --concurrency`: the closed loop keeps C requests in flight and finishes every prompt, greedy
outputs are the same at every concurrency, the report holds its fields and renders, OpenVINO GenAI's continuous
batching is driven the same way (a recording stand-in: no OpenVINO needed), and a bad --concurrency is one line."""

import json
import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner

from specbuild.bench.load import (
    Finished,
    OpenVINOLoad,
    SchedulerLoad,
    closed_loop,
    median_round,
    parse_concurrency,
    render_load,
    run_load,
)
from specbuild.cli.main import cli
from specbuild.errors import SpecbuildError
from tests.conftest import ORT_ONLY, full, quiet

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


def _fake_openvino(monkeypatch, calls):
    """openvino_genai's ContinuousBatchingPipeline stand-in: every step adds one token (its id = the step) to each
    running request, which finishes after max_new_tokens."""

    class Handle:
        def __init__(self, config):
            self.left, self.new, self.status = config.max_new_tokens, [], "RUNNING"

        def can_read(self):
            return bool(self.new)

        def read(self):
            out, self.new = types.SimpleNamespace(generated_ids=self.new), []
            return {0: out}

        def get_status(self):
            return getattr(Status, self.status)

    class Pipeline:
        def __init__(self, path, scheduler_config, device, properties):
            calls.append(("load", device, properties, dict(vars(scheduler_config))))
            self.handles, self.steps = [], 0

        def get_config(self):
            return types.SimpleNamespace(max_new_tokens=None, do_sample=True)

        def add_request(self, request_id, inputs, config):
            calls.append(("add", request_id, inputs.ids, config.max_new_tokens, config.do_sample))
            self.handles.append(Handle(config))
            return self.handles[-1]

        def has_non_finished_requests(self):
            return any(h.status == "RUNNING" for h in self.handles)

        def step(self):
            self.steps += 1
            for h in self.handles:
                if h.status == "RUNNING":
                    h.new.append(self.steps)
                    h.left -= 1
                    h.status = "FINISHED" if h.left == 0 else "RUNNING"

    Status = types.SimpleNamespace(RUNNING="RUNNING", FINISHED="FINISHED")
    genai = types.ModuleType("openvino_genai")
    genai.ContinuousBatchingPipeline, genai.SchedulerConfig, genai.GenerationStatus = (
        Pipeline,
        types.SimpleNamespace,
        Status,
    )
    ov = types.ModuleType("openvino")
    ov.Tensor = lambda array: types.SimpleNamespace(ids=array.tolist(), dtype=array.dtype)
    hint = types.SimpleNamespace(get_type_name=lambda: "bf16")  # a CPU with AVX-512 BF16: OpenVINO computes in bf16
    ov.Core = lambda: types.SimpleNamespace(get_property=lambda device, name: hint)
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setitem(sys.modules, "openvino", ov)


def test_openvino_continuous_batching_runs_the_same_closed_loop(tmp_path, monkeypatch):
    with pytest.raises(SpecbuildError, match="not an OpenVINO model directory"):
        OpenVINOLoad(tmp_path, threads=1, max_num_seqs=4, max_new_tokens=3)
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    calls = []
    _fake_openvino(monkeypatch, calls)
    peer = OpenVINOLoad(tmp_path, threads=2, max_num_seqs=4, max_new_tokens=3)
    run = closed_loop(peer, PROMPTS[:5], 2)
    (_, device, properties, scheduler), *adds = calls
    assert device == "CPU" and properties == {"INFERENCE_NUM_THREADS": 2}
    assert scheduler["max_num_seqs"] == 4 and scheduler["dynamic_split_fuse"] is True
    assert [a[2] for a in adds] == [[p] for p in PROMPTS[:5]] and {a[3:] for a in adds} == {(3, False)}
    assert peer.label == f"OpenVINO GenAI CB {tmp_path.name} (bf16 compute)"  # not fp32 greedy: the row says so
    assert run.most_in_flight == 2 and all(len(r.output_ids) == 3 for r in run.done)
    assert run.done[0].output_ids == [1, 2, 3] and run.done[2].output_ids == [4, 5, 6]  # joined when one left
    assert all(0 <= r.ttft_s <= r.last_token_s <= r.latency_s for r in run.done)
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # not installed
    with pytest.raises(SpecbuildError, match="pip install openvino-genai"):
        OpenVINOLoad(tmp_path, threads=1, max_num_seqs=4, max_new_tokens=3)


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
    assert res.exit_code == 1 and "belong to the one-at-a-time benchmark" in res.output


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


@full("ONNX Runtime GenAI's model builder on a tiny model")
def test_ort_genai_static_batch_gives_greedy_ids_through_the_closed_loop(tiny_hf_models, tmp_path):
    """The static-batch reference row: prompts of different lengths batched (padded) give transformers' greedy
    ids one by one; a request submitted while a batch runs waits for the next one."""
    pytest.importorskip("onnxruntime_genai")
    import shutil
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM

    from specbuild.bench.load import OrtGenAIBatch
    from tests.conftest import hf_greedy, write_char_tokenizer

    hf = shutil.copytree(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "hf")
    write_char_tokenizer(hf)
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", tmp_path / "genai"]
    subprocess.run([*map(str, builder), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    peer = OrtGenAIBatch(tmp_path / "genai", threads=1, max_new_tokens=MAX_NEW_TOKENS)
    assert peer.label == "ORT GenAI static batch genai"
    run = closed_loop(peer, PROMPTS, 3)
    assert [r.output_ids for r in run.done] == [hf_greedy(model, ids, MAX_NEW_TOKENS) for ids in PROMPTS]
    assert run.most_in_flight == 3 and all(0 <= r.ttft_s <= r.last_token_s <= r.latency_s for r in run.done)
    # static: 7 prompts at 3 in flight are three batches of MAX_NEW_TOKENS steps (EOS aside: random ids)
    assert run.steps == 3 * MAX_NEW_TOKENS
    with pytest.raises(SpecbuildError, match="not an ONNX Runtime GenAI model directory"):
        OrtGenAIBatch(hf, threads=1, max_new_tokens=4)


def test_transformers_static_batch_gives_greedy_ids_through_the_closed_loop(tiny_hf_models):
    """The transformers row under load: prompts of different lengths, left-padded in one batch, give transformers'
    own greedy ids one by one; a request submitted while a batch runs waits for the next one."""
    import torch
    from transformers import AutoModelForCausalLM

    from specbuild.bench.load import HFBatch
    from tests.conftest import hf_greedy

    hf = tiny_hf_models["llama_gqa_llama3rope"]
    peer = HFBatch(hf, threads=1, max_new_tokens=MAX_NEW_TOKENS)
    peer.eos = set()  # random weights: run every request to max_new_tokens, as hf_greedy's generate may not stop
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    run = closed_loop(peer, PROMPTS, 3)
    assert [r.output_ids for r in run.done] == [hf_greedy(model, ids, MAX_NEW_TOKENS) for ids in PROMPTS]
    assert run.most_in_flight == 3 and all(0 <= r.ttft_s <= r.last_token_s <= r.latency_s for r in run.done)
    assert run.steps == 3 * MAX_NEW_TOKENS  # static: 7 prompts at 3 in flight are three batches
    assert peer.label == f"HF transformers static batch {hf.name}"


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


def test_openvino_continuous_batching_gets_each_request_its_sampling(tmp_path, monkeypatch):
    from specbuild.runtime.engine import SamplingParams

    (tmp_path / "openvino_model.xml").write_text("<net/>")
    calls = []
    _fake_openvino(monkeypatch, calls)
    peer = OpenVINOLoad(tmp_path, threads=2, max_num_seqs=4, max_new_tokens=3)
    seen = []
    add = peer.pipe.add_request
    peer.pipe.add_request = lambda i, inputs, config: seen.append(dict(vars(config))) or add(i, inputs, config)
    closed_loop(peer, PROMPTS[:3], 2, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=10))
    assert [(s["do_sample"], s["temperature"], s["top_k"], s["top_p"], s["rng_seed"]) for s in seen] == [
        (True, 0.7, 5, 0.9, 10 + i) for i in range(3)
    ]


def test_transformers_static_batch_samples_with_its_seed(tiny_hf_models):
    """A sampled static batch draws after transformers' own warpers from a generator seeded by the batch's first
    request: the same seed repeats its tokens, another seed gives others."""
    from specbuild.bench.load import HFBatch
    from specbuild.runtime.engine import SamplingParams

    peer = HFBatch(tiny_hf_models["llama_gqa_llama3rope"], threads=1, max_new_tokens=MAX_NEW_TOKENS)
    peer.eos = set()

    def outputs(seed):
        sampling = SamplingParams(temperature=1.5, top_k=20, top_p=0.95, seed=seed)
        return [r.output_ids for r in closed_loop(peer, PROMPTS, 3, sampling).done]

    assert outputs(1) == outputs(1) != outputs(2)
