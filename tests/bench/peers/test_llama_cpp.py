"""The llama.cpp peer (bench/peers/llama_cpp.py), driven against a recording stand-in of the llama_cpp binding
(llama-cpp-python compiles llama.cpp when installed, ~25 minutes on 2 cores; the real one is measured in the
benchmark runs): greedy and prompt-lookup rows on the same ids from an empty cache, the request's sampling with its
other samplers off, EOS and max_new_tokens honoured; a missing file, a non-GGUF file, a missing package, and
--concurrency are one line."""

import sys
import types

import pytest

from specbuild.bench.peers import llama_cpp
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import SamplingParams


def _fake_binding(monkeypatch, calls):
    class Llama:
        def __init__(self, model_path, **kwargs):
            calls.append(("load", model_path, kwargs))
            self.draft_model = kwargs.get("draft_model")

        def token_eos(self):
            return 2

        def reset(self):
            calls.append(("reset",))

        def set_seed(self, seed):
            calls.append(("seed", seed))

        def generate(self, tokens, **settings):
            calls.append(("generate", list(tokens), settings, self.draft_model))
            yield from [7, 8, 9, 2, 5]  # the 4th is EOS

    module = types.ModuleType("llama_cpp")
    module.Llama = Llama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda num_pred_tokens: ("lookup", num_pred_tokens)
    module.llama_speculative = speculative
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)


def test_llama_cpp_rows_run_its_own_loop_greedy_sampled_and_with_prompt_lookup(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []
    _fake_binding(monkeypatch, calls)
    plain, lookup = llama_cpp.STACK.sequential({"llama_cpp_models": [gguf]}, threads=2, eos_ids={2})
    assert (plain.label, lookup.label) == ("llama.cpp model.gguf", "llama.cpp model.gguf prompt lookup")
    assert (plain.ngram, lookup.ngram) == (False, True)
    (_, path, kwargs), (_, _, lookup_kwargs) = calls.pop(0), calls.pop(0)  # a plain instance, one that drafts
    assert path == str(gguf) and kwargs["n_threads"] == 2 and kwargs["n_gpu_layers"] == 0
    assert "draft_model" not in kwargs and lookup_kwargs["draft_model"] == ("lookup", 10)
    sample = plain.sample([1, 5, 9], 10)
    assert sample.output_ids == [7, 8, 9, 2] and 0 < sample.ttft_s <= sample.total_s  # stops at EOS
    assert calls[0] == ("reset",)
    _, ids, settings, draft = calls[1]
    assert ids == [1, 5, 9] and draft is None
    assert settings == {"min_p": 0.0, "repeat_penalty": 1.0, "reset": True, "temp": 0.0, "top_k": 1, "top_p": 1.0}
    calls.clear()
    assert lookup.sample([1, 5, 9], 2, SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11)).output_ids == [
        7,
        8,
    ]
    (_,), seed, (_, _, settings, draft) = calls
    assert seed == ("seed", 11) and draft == ("lookup", 10)
    assert (settings["temp"], settings["top_k"], settings["top_p"], settings["min_p"]) == (0.7, 20, 0.9, 0.0)


def test_llama_cpp_refuses_what_it_cannot_run_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(SpecbuildError, match="takes a .gguf file"):
        llama_cpp.STACK.sequential({"llama_cpp_models": [tmp_path / "missing.gguf"]}, None, set())
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(SpecbuildError, match="takes a .gguf file"):
        llama_cpp.STACK.sequential({"llama_cpp_models": [tmp_path / "model.bin"]}, None, set())
    (tmp_path / "model.gguf").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(SpecbuildError, match="pip install llama-cpp-python"):
        llama_cpp.STACK.sequential({"llama_cpp_models": [tmp_path / "model.gguf"]}, None, set())
    with pytest.raises(SpecbuildError, match="one request at a time"):
        llama_cpp.STACK.check({"llama_cpp_models": [tmp_path / "model.gguf"]}, under_load=True)
