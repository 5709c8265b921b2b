"""ONNX Runtime GenAI (--ort-genai-model, a directory of its model builder): greedy or sampled, and its n-gram
speculation; under load a static batch of the requests waiting (GenAI has no continuous batching on CPU)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from specbuild.bench import decoding
from specbuild.bench.peers.base import PeerOption, PeerStack, StaticBatch, model_dirs
from specbuild.bench.results import Sample
from specbuild.errors import SpecbuildError


def open_genai_model(model_dir, threads: int | None):
    """(onnxruntime_genai, its Model on the CPU) of a directory made by its model builder; one-line errors."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise SpecbuildError(
            "--ort-genai-model needs the onnxruntime-genai package (pip install onnxruntime-genai)"
        ) from None
    model_dir = Path(model_dir)
    if not (model_dir / "genai_config.json").is_file():
        raise SpecbuildError(f"{model_dir}: not an ONNX Runtime GenAI model directory (no genai_config.json)")
    config = og.Config(str(model_dir))
    config.clear_providers()  # CPU
    if threads:
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    try:
        return og, og.Model(config)
    except Exception as exc:  # onnxruntime-genai raises RuntimeError for unreadable models
        raise SpecbuildError(f"{model_dir}: ONNX Runtime GenAI cannot load it ({exc})") from None


def genai_min_length(model_dir) -> int:
    """The least max_length a GenAI generator of this model takes: a model with a sliding window (Gemma 3) keeps a
    cache of at least the window; a shorter max_length is refused. Generation stops at max_new_tokens anyway."""
    config = json.loads((Path(model_dir) / "genai_config.json").read_text())
    window = ((config.get("model") or {}).get("decoder") or {}).get("sliding_window") or {}
    return int(window.get("window_size") or 0)


class OrtGenAITimer:
    """ONNX Runtime GenAI (what a CPU user would run instead) on the same ids: greedy, or with its built-in n-gram
    speculation (`ngram_size` 3, 4 draft tokens). Needs the `onnxruntime-genai` package and a model directory made
    by its model builder (`python -m onnxruntime_genai.models.builder -i HF_DIR -o DIR -p int4 -e cpu`)."""

    NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}

    def __init__(self, model_dir, threads: int | None, ngram: bool = False):
        self.og, self.model = open_genai_model(model_dir, threads)
        self.min_length = genai_min_length(model_dir)
        self.ngram = ngram
        self.label = f"ORT GenAI {Path(model_dir).name}" + (" n-gram" if ngram else "")

    def sample(self, ids: list[int], max_new_tokens: int, sampling=None) -> Sample:
        og = self.og
        params = og.GeneratorParams(self.model)
        length = max(len(ids) + max_new_tokens, self.min_length)
        params.set_search_options(max_length=length, batch_size=1, **decoding.genai_search_options(sampling))
        if self.ngram:
            params.set_speculative_options(**self.NGRAM)
        gen = og.Generator(self.model, params)
        start = time.perf_counter()
        gen.append_tokens(ids)
        ttft = None
        while not gen.is_done() and gen.token_count() - len(ids) < max_new_tokens:
            gen.generate_next_token()
            if ttft is None:
                ttft = time.perf_counter() - start
        total = time.perf_counter() - start
        out = list(gen.get_sequence(0))[len(ids) : len(ids) + max_new_tokens]
        steps = accepted = 0
        if self.ngram:
            stats = gen.get_speculative_stats()
            # its decode calls: those of speculative rounds (verify and re-anchor) and the plain steps it fell back
            # to where no n-gram matched (target_forward_passes alone leaves those out: a τ above its draft length),
            # less the prompt's call, which it counts as a fallback step
            calls = int(stats.get("target_forward_passes", 0)) + int(stats.get("standard_fallback_steps", 0))
            steps = max(calls - 1, 0)
            accepted = len(out) - 1 if steps else 0
        return Sample(out, steps, accepted, total, ttft or total, decode_engine_s=0.0)


class OrtGenAIBatch(StaticBatch):
    """ONNX Runtime GenAI with a static batch, the reference for what ONNX Runtime's kernels give a batch on this CPU
    (GenAI has no continuous batching on CPU): the prompts padded on the right with its pad id (GenAI's convention:
    with left padding a shorter prompt's output changes). Greedy on the same ids. Needs the `onnxruntime-genai`
    package and a directory made by its model builder (see sequential.OrtGenAITimer)."""

    def __init__(self, model_dir, threads: int | None, max_new_tokens: int):

        self.og, self.model = open_genai_model(model_dir, threads)
        self.min_length = genai_min_length(model_dir)
        config = json.loads((Path(model_dir) / "genai_config.json").read_text())["model"]
        eos = config.get("eos_token_id", [])
        super().__init__(set(eos if isinstance(eos, list) else [eos]), max_new_tokens)
        self.pad = int(config.get("pad_token_id", next(iter(self.eos), 0)))
        self.label = f"ORT GenAI static batch {Path(model_dir).name}"
        self._generator = None

    def _start(self, requests: list[dict]) -> None:
        if not requests:
            self._generator = None
            return
        og = self.og
        longest = max(len(r["ids"]) for r in requests)
        tokens = np.full((len(requests), longest), self.pad, dtype=np.int32)
        for row, request in enumerate(requests):
            tokens[row, : len(request["ids"])] = request["ids"]
        params = og.GeneratorParams(self.model)
        length = max(longest + self.max_new_tokens, self.min_length)
        search = decoding.genai_search_options(requests[0]["sampling"])
        params.set_search_options(max_length=length, batch_size=len(requests), **search)
        self._generator = og.Generator(self.model, params)
        self._generator.append_tokens(tokens)

    def _next(self) -> list[int]:
        self._generator.generate_next_token()
        return list(self._generator.get_next_tokens())


class OrtGenAIStack(PeerStack):
    name = "ONNX Runtime GenAI"
    options = (
        PeerOption(
            "--ort-genai-model",
            "ort_genai_dirs",
            "Also time ONNX Runtime GenAI on this model directory (greedy and its n-gram speculation; with "
            "--concurrency, a static batch of the requests waiting); needs the onnxruntime-genai package.",
        ),
    )

    def sequential(self, args: dict, threads: int | None, eos_ids: set[int]) -> list:
        return [OrtGenAITimer(d, threads, ngram) for d in model_dirs(args, "ort_genai_dirs") for ngram in (False, True)]

    def load(self, args: dict, threads: int | None, max_num_seqs: int, max_new_tokens: int) -> list:
        return [OrtGenAIBatch(d, threads, max_new_tokens) for d in model_dirs(args, "ort_genai_dirs")]


STACK = OrtGenAIStack()
