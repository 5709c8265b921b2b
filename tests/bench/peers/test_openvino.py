"""The OpenVINO GenAI peer (bench/peers/openvino.py), driven against a recording stand-in of openvino_genai (its export
needs optimum-intel, which needs another transformers than this project's; the real one is measured in the
benchmark runs): LLMPipeline asked for greedy and prompt lookup, the continuous batching pipeline through the same
closed loop, each request with its sampling; a directory without a model or a missing package is one line."""

import sys
import types

import pytest

from specbuild.bench.load import closed_loop
from specbuild.bench.peers.openvino import OpenVINOLoad
from specbuild.errors import SpecbuildError
from tests.bench.test_load import PROMPTS


def test_openvino_peer_rows_ask_for_greedy_and_prompt_lookup(tmp_path, monkeypatch):
    """`--openvino-model` adds OpenVINO GenAI's LLMPipeline, greedy and with prompt lookup, fed the same ids; a
    directory without an OpenVINO model or a missing package is one line. (Its export needs optimum-intel, which
    needs another transformers than this project's: the pipeline itself is replaced by a recording stand-in here,
    and the real one is measured in the README's benchmark runs.)"""
    import sys
    import types

    import numpy as np

    from specbuild.bench.peers.openvino import OpenVINOTimer
    from specbuild.errors import SpecbuildError

    with pytest.raises(SpecbuildError, match="not an OpenVINO model directory"):
        OpenVINOTimer(tmp_path, threads=1)
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    calls = []

    class Pipeline:
        def __init__(self, path, device, **properties):
            calls.append(("load", path, device, properties))

        def generate(self, inputs, config):
            assert inputs.dtype == np.int64
            calls.append(("generate", inputs.ids, dict(vars(config))))
            metrics = types.SimpleNamespace(get_ttft=lambda: types.SimpleNamespace(mean=5.0))
            return types.SimpleNamespace(tokens=[[7, 8, 9, 10]], perf_metrics=metrics)

    genai = types.ModuleType("openvino_genai")
    genai.LLMPipeline, genai.GenerationConfig = Pipeline, types.SimpleNamespace
    ov = types.ModuleType("openvino")
    ov.Tensor = lambda array: types.SimpleNamespace(ids=array.tolist(), dtype=array.dtype)
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setitem(sys.modules, "openvino", ov)
    for lookup in (False, True):
        timer = OpenVINOTimer(tmp_path, threads=2, prompt_lookup=lookup)
        sample = timer.sample([1, 5, 9], 3)
        assert sample.output_ids == [7, 8, 9] and sample.ttft_s <= sample.total_s
        assert timer.ngram == lookup and ("prompt lookup" in timer.label) == lookup
    (_, _, _, greedy_props), (_, ids, greedy), (_, _, _, lookup_props), (_, _, lookup) = calls
    assert greedy_props == {"INFERENCE_NUM_THREADS": 2} and lookup_props == {**greedy_props, "prompt_lookup": True}
    assert ids == [[1, 5, 9]] and greedy == {"max_new_tokens": 3, "do_sample": False}
    assert lookup == {**greedy, "num_assistant_tokens": 5, "max_ngram_size": 3}
    monkeypatch.setitem(sys.modules, "openvino_genai", None)  # not installed
    with pytest.raises(SpecbuildError, match="pip install openvino-genai"):
        OpenVINOTimer(tmp_path, threads=1)


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
