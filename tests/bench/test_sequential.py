"""Benchmark report arithmetic: speed-up over the baseline, η and speed relative to the fastest other row."""

import json

import pytest

from specbuild.bench import sequential
from specbuild.bench.sequential import add_relative_speed, render
from specbuild.errors import SpecbuildError
from tests.conftest import full


def _rows():
    return {
        "none": {"tokens_per_s": 30.0, "tau": 1.0},
        "medusa": {"tokens_per_s": 33.0, "tau": 1.5},
        "eagle3": {"tokens_per_s": 39.6, "tau": 2.2},
    }


def test_speedups_are_relative_to_the_baseline_and_to_the_fastest_other_row():
    rows = _rows()
    peers = {"ORT GenAI int4": {"tokens_per_s": 36.0}}
    add_relative_speed(rows, "none", peers)
    assert rows["eagle3"]["speedup"] == pytest.approx(1.32)
    assert rows["eagle3"]["eta"] == pytest.approx(1.32 / 2.2)
    assert rows["eagle3"]["vs_fastest"] == pytest.approx(39.6 / 36.0)  # faster than every alternative
    assert rows["medusa"]["vs_fastest"] == pytest.approx(33.0 / 39.6) and rows["none"]["speedup"] == pytest.approx(1)
    peer = peers["ORT GenAI int4"]
    assert peer["vs_fastest"] == pytest.approx(36.0 / 39.6) and "speedup" not in peer


def test_without_baseline_the_speedups_are_absent():
    rows = _rows()
    add_relative_speed(rows, None)
    assert all(r["speedup"] is None and r["eta"] is None for r in rows.values())
    assert rows["eagle3"]["vs_fastest"] == pytest.approx(1.2)


def test_render_names_no_mode_in_its_columns():
    from rich.console import Console

    rows = _rows()
    add_relative_speed(rows, "none")
    for r in rows.values():
        r.update(decode_tokens_per_s=r["tokens_per_s"], ttft_ms=100.0, host_ms_per_step=0.5, host_share=0.01)
        r.update(prompts=1, matches_baseline=1)
    report = {
        "settings": {"num_prompts": 1, "max_new_tokens": 8},
        "baseline": "none",
        "results": {"humaneval": {"engines": rows}},
    }
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert "vs fastest other" in text and "1.20" in text and "1.32" in text
    header = next(line for line in text.splitlines() if "tok/s" in line)
    assert "medusa" not in header and "eagle" not in header
    rows["eagle3"].update(own_none="int4 none", matches_own_none=1)  # an int4 engine: its own none is the reference
    console = Console(record=True, width=240)
    render(report, console)
    assert "(own none 1/1)" in console.export_text()


@full("ONNX Runtime GenAI's model builder on a tiny model")
def test_ort_genai_peer_rows_are_greedy_and_its_ngram_is_lossless(tiny_hf_models, tmp_path):
    """The ONNX Runtime GenAI rows of `specbuild bench` time what a CPU user would run instead: its model builder's
    graph of the same checkpoint, greedy and with its n-gram speculation, both giving transformers' greedy ids."""
    pytest.importorskip("onnxruntime_genai")
    import shutil
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from specbuild.bench.sequential import OrtGenAITimer
    from specbuild.errors import SpecbuildError
    from tests.conftest import hf_greedy, write_char_tokenizer

    hf = shutil.copytree(tiny_hf_models["llama_gqa_llama3rope"], tmp_path / "hf")
    write_char_tokenizer(hf)  # the model builder copies a tokenizer into its output
    builder = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", tmp_path / "genai"]
    subprocess.run([*map(str, builder), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    for ids in ([1, 5, 9, 3, 7, 5, 9, 3], [2, 40, 41]):
        want = hf_greedy(model, ids, 24)
        for ngram in (False, True):
            sample = OrtGenAITimer(tmp_path / "genai", threads=1, ngram=ngram).sample(ids, 24)
            assert sample.output_ids == want, ngram
            assert sample.total_s > 0 and sample.ttft_s <= sample.total_s
            if ngram:  # a call emits at most its drafts + 1 (its plain fallback steps count; a re-anchor emits none)
                assert sample.accepted == 23 <= (1 + OrtGenAITimer.NGRAM["max_draft_tokens"]) * sample.steps
    from specbuild.runtime.engine import SamplingParams

    timer = OrtGenAITimer(tmp_path / "genai", threads=1)  # sampled (bench --temperature): its seed repeats it
    runs = [timer.sample(ids, 24, SamplingParams(temperature=1.5, top_p=0.95, seed=s)).output_ids for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2] and runs[0] != want
    with pytest.raises(SpecbuildError, match="not an ONNX Runtime GenAI model directory"):
        OrtGenAITimer(hf, threads=1)


def test_transformers_rows_greedy_and_prompt_lookup_give_its_greedy_ids(tiny_hf_models):
    """`--hf-model-dir` adds transformers' greedy generate and its prompt lookup decoding; both are exact."""
    from specbuild.bench.sequential import HFTimer
    from tests.conftest import hf_greedy

    model = HFTimer.load(tiny_hf_models["llama_gqa_llama3rope"], threads=1)
    ids = [1, 5, 9, 3, 7, 5, 9, 3]
    want = hf_greedy(model, ids, 20)
    for lookup in (None, 10):
        timer = HFTimer(model, eos_ids=set(), prompt_lookup=lookup)
        sample = timer.sample(ids, 20)
        assert sample.output_ids[: len(want)] == want and timer.ngram == bool(lookup)
    assert "prompt lookup 10" in timer.label


def test_transformers_assisted_generation_with_a_draft_that_borrows_the_embedding(tmp_path, tiny_hf_models):
    """`--hf-assistant-dir`: transformers' assisted generation with a draft model, here one saved without its
    embedding (config.json says it takes the target's, as the draft shipped for SmolLM2 does); exact greedy ids."""
    import torch
    from safetensors.torch import load_file, save_file

    from specbuild.bench.sequential import HFTimer
    from specbuild.errors import SpecbuildError
    from tests.conftest import hf_greedy, tiny_hf_model

    model = HFTimer.load(tiny_hf_models["llama_tied_linear"], threads=1)
    draft = tiny_hf_model("llama_tied_linear", seed=5, num_hidden_layers=1)
    draft.save_pretrained(tmp_path / "draft")
    tensors = load_file(tmp_path / "draft" / "model.safetensors")
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, tmp_path / "draft" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    config["specbuild"] = {"embeddings": "target"}
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))
    assistant = HFTimer.load_assistant(tmp_path / "draft", model)
    embed = model.get_input_embeddings().weight
    assert torch.equal(assistant.get_input_embeddings().weight, embed)
    assert torch.equal(assistant.get_output_embeddings().weight, embed)  # tied, as in the target
    ids = [1, 5, 9, 3, 7, 5, 9, 3]
    timer = HFTimer(model, eos_ids=set(), assistant=assistant, assistant_name="draft")
    assert timer.sample(ids, 20).output_ids[:20] == hf_greedy(model, ids, 20)[:20]
    assert timer.label == "HF transformers assisted generation (draft)"
    with pytest.raises(SpecbuildError, match="--hf-assistant-dir does not exist"):
        HFTimer.load_assistant(tmp_path / "nowhere", model)


def test_the_plot_shows_every_row_of_every_prompt_set(tmp_path):
    pytest.importorskip("matplotlib")
    from specbuild.bench.plot import rows_of, write_plot

    rows = _rows()
    add_relative_speed(rows, "none")
    peers = {"ORT GenAI int4": {"tokens_per_s": 36.0}, "ORT GenAI int4 n-gram": {"tokens_per_s": 41.0, "tau": 3.1}}
    report = {
        "settings": {"num_prompts": 2, "max_new_tokens": 8},
        "baseline": "none",
        "results": {name: {"engines": rows, "peers": peers} for name in ("humaneval", "summarize")},
    }
    assert [label for label, _, _ in rows_of(report["results"]["summarize"])] == [*rows, *peers]
    png = write_plot(report, tmp_path / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_openvino_peer_rows_ask_for_greedy_and_prompt_lookup(tmp_path, monkeypatch):
    """`--openvino-model` adds OpenVINO GenAI's LLMPipeline, greedy and with prompt lookup, fed the same ids; a
    directory without an OpenVINO model or a missing package is one line. (Its export needs optimum-intel, which
    needs another transformers than this project's: the pipeline itself is replaced by a recording stand-in here,
    and the real one is measured in the README's benchmark runs.)"""
    import sys
    import types

    import numpy as np

    from specbuild.bench.sequential import OpenVINOTimer
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


def test_engines_that_do_not_fit_together_are_refused_before_any_loads(tmp_path, monkeypatch):
    small, large = tmp_path / "small", tmp_path / "large"
    for path, size in ((small, 1000), (large, 3000)):
        path.mkdir()
        (path / "weights.bin").write_bytes(b"\0" * size)
    sequential.check_engines_fit([small, large], None)  # nothing known about the machine: no check
    sequential.check_engines_fit([small, large], 4000)
    with pytest.raises(SpecbuildError, match=r"the 2 engines take .*\(the largest, .*large, takes"):
        sequential.check_engines_fit([small, large], 3999)
    monkeypatch.setattr(sequential, "available_bytes", lambda: 10)
    monkeypatch.setattr("specbuild.runtime.engine.Engine", lambda *a, **k: pytest.fail("an engine was loaded"))
    with pytest.raises(SpecbuildError, match="run fewer engines per benchmark"):
        sequential.load_engines([small, large], 16, None, False)


def test_transformers_rows_sample_with_the_request_seed(tiny_hf_models):
    """`bench --temperature`: transformers' generate samples with the request's settings, seeded by its seed."""
    from specbuild.bench.sequential import HFTimer
    from specbuild.runtime.engine import SamplingParams
    from tests.conftest import hf_greedy

    model = HFTimer.load(tiny_hf_models["llama_gqa_llama3rope"], threads=1)
    timer, ids = HFTimer(model, eos_ids=set()), [1, 5, 9, 3, 7]

    def sampled(seed):
        return timer.sample(ids, 12, SamplingParams(temperature=1.5, top_k=30, top_p=0.95, seed=seed)).output_ids

    assert sampled(4) == sampled(4) != sampled(5)
    assert sampled(4) != hf_greedy(model, ids, 12)


def test_sampled_bench_seeds_each_prompt_and_says_so(tmp_path, monkeypatch):
    """Prompt i of a sampled run is seeded with --seed + i in every engine and peer; the title says how it decoded;
    a bad sampling option is one line naming its flag."""
    from click.testing import CliRunner

    from specbuild.bench import decoding
    from specbuild.cli.main import cli
    from specbuild.runtime.engine import SamplingParams

    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
    assert [decoding.for_request(sampling, i).seed for i in range(3)] == [5, 6, 7]
    assert decoding.for_request(None, 2) == SamplingParams() == decoding.for_request(SamplingParams(seed=9), 1)
    record = decoding.to_dict(sampling)
    assert decoding.describe(record) == "sampled (T 0.7, top-p 0.9, seed 5)" and decoding.describe(None) == "greedy"
    report = {
        "settings": {"num_prompts": 1, "max_new_tokens": 8, "sampling": record},
        "baseline": None,
        "results": {"mtbench": {"engines": {}, "peers": {}}},
    }
    from rich.console import Console

    console = Console(record=True, width=240)
    render(report, console)
    assert "1 prompts, sampled (T 0.7, top-p 0.9, seed 5)" in console.export_text()
    res = CliRunner().invoke(cli, ["bench", "--engine-dir", str(tmp_path), "--temperature", "0.7", "--top-p", "2"])
    assert res.exit_code == 1 and res.output.strip() == "error: --top-p must be a number in (0, 1] (1 = off), got 2.0"
