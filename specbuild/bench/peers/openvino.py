"""OpenVINO GenAI (--openvino-model, a directory made by optimum-intel): its LLMPipeline, greedy or sampled, and its
prompt lookup; under load its ContinuousBatchingPipeline (dynamic split-fuse) as a closed-loop target."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specbuild.bench import decoding
from specbuild.bench.peers.base import PeerOption, PeerStack, model_dirs
from specbuild.bench.results import Finished, Sample
from specbuild.errors import SpecbuildError

OPENVINO_CACHE_GB = 2


def import_openvino(model_dir):
    """(model dir, openvino, openvino_genai) for an OpenVINO model directory; one-line errors otherwise."""
    model_dir = Path(model_dir)
    if not (model_dir / "openvino_model.xml").is_file():
        raise SpecbuildError(f"{model_dir}: not an OpenVINO model directory (no openvino_model.xml)")
    try:
        import openvino as ov
        import openvino_genai as ov_genai
    except ImportError:
        missing = "--openvino-model needs the openvino-genai package (pip install openvino-genai)"
        raise SpecbuildError(missing) from None
    return model_dir, ov, ov_genai


def openvino_compute(ov) -> str:
    """' (bf16 compute)' where OpenVINO's CPU plugin computes below f32 by default (its INFERENCE_PRECISION_HINT is
    bf16 on CPUs with AVX-512 BF16 or AMX, whatever the model's weights): a row label must say so, its output then
    differs from fp32 greedy; '' otherwise."""
    try:
        precision = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    except Exception:  # noqa: BLE001 - an OpenVINO without the property: label as before
        return ""
    return "" if precision == "f32" else f" ({precision} compute)"


class OpenVINOTimer:
    """OpenVINO GenAI's LLMPipeline (what an Intel/AMD CPU user would also run) on the same ids: greedy, or with its
    prompt lookup (`num_assistant_tokens` 5, `max_ngram_size` 3, its documented example). Needs the `openvino-genai`
    package and an OpenVINO model directory made by optimum-intel (`optimum-cli export openvino --model HF_DIR --task
    text-generation-with-past --weight-format int4 --group-size 64 DIR`; docs/benchmarking.md: setting it up
    offline)."""

    PROMPT_LOOKUP = {"num_assistant_tokens": 5, "max_ngram_size": 3}

    def __init__(self, model_dir, threads: int | None, prompt_lookup: bool = False):
        model_dir, ov, ov_genai = import_openvino(model_dir)
        self.ov, self.ov_genai, self.ngram = ov, ov_genai, prompt_lookup
        properties = {"INFERENCE_NUM_THREADS": threads} if threads else {}
        if prompt_lookup:
            properties["prompt_lookup"] = True
        try:
            self.pipe = ov_genai.LLMPipeline(str(model_dir), "CPU", **properties)
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError for unreadable models
            raise SpecbuildError(f"{model_dir}: OpenVINO GenAI cannot load it ({exc})") from None
        lookup = " prompt lookup" if prompt_lookup else ""
        self.label = f"OpenVINO GenAI {model_dir.name}{lookup}{openvino_compute(ov)}"

    def sample(self, ids: list[int], max_new_tokens: int, sampling=None) -> Sample:
        config = self.ov_genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        decoding.set_openvino(config, sampling)
        if self.ngram:
            config.num_assistant_tokens = self.PROMPT_LOOKUP["num_assistant_tokens"]
            config.max_ngram_size = self.PROMPT_LOOKUP["max_ngram_size"]
        inputs = self.ov.Tensor(np.array([ids], dtype=np.int64))
        start = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        total = time.perf_counter() - start
        out = [int(t) for t in result.tokens[0]][:max_new_tokens]
        ttft = float(result.perf_metrics.get_ttft().mean) / 1000.0  # ms
        return Sample(out, 0, 0, total, min(ttft, total) if ttft > 0 else total, decode_engine_s=0.0)


class OpenVINOLoad:
    """OpenVINO GenAI's continuous batching (ContinuousBatchingPipeline, dynamic split-fuse) as a closed-loop target,
    on the same ids; TTFT and inter-token times from when each step's new tokens are read. Needs the
    `openvino-genai` package and an OpenVINO model directory (see benchmark.OpenVINOTimer)."""

    def __init__(self, model_dir, threads: int | None, max_num_seqs: int, max_new_tokens: int):

        model_dir, ov, ov_genai = import_openvino(model_dir)
        scheduler_config = ov_genai.SchedulerConfig()
        scheduler_config.cache_size = OPENVINO_CACHE_GB
        scheduler_config.max_num_seqs = max_num_seqs
        scheduler_config.dynamic_split_fuse = True
        properties = {"INFERENCE_NUM_THREADS": threads} if threads else {}
        try:
            self.pipe = ov_genai.ContinuousBatchingPipeline(str(model_dir), scheduler_config, "CPU", properties)
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError for unreadable models
            raise SpecbuildError(f"{model_dir}: OpenVINO GenAI cannot load it ({exc})") from None
        self.config = self.pipe.get_config()  # the model's EOS ids
        self.max_new_tokens = max_new_tokens
        self.ov, self.status = ov, ov_genai.GenerationStatus
        self.label = f"OpenVINO GenAI CB {model_dir.name}{openvino_compute(ov)}"
        self._next_id = 0
        self._live: list[dict] = []

    def submit(self, ids: list[int], sampling) -> dict:
        self._next_id += 1
        inputs = self.ov.Tensor(np.array([ids], dtype=np.int64))
        self.config.max_new_tokens = self.max_new_tokens  # the request keeps its own copy
        decoding.set_openvino(self.config, sampling)
        request = {"handle": self.pipe.add_request(self._next_id, inputs, self.config), "ids": [], "times": []}
        request["arrival"] = time.perf_counter()
        self._live.append(request)
        return request

    def step(self) -> bool:
        if not self.pipe.has_non_finished_requests():
            return False
        self.pipe.step()
        for request in self._live:
            self._read(request)
        return True

    def _read(self, request: dict) -> None:
        handle, now = request["handle"], time.perf_counter() - request["arrival"]
        while handle.can_read():
            for output in handle.read().values():
                new = [int(t) for t in output.generated_ids]
                request["ids"] += new
                request["times"] += [now] * len(new)

    def finished(self, request: dict) -> Finished | None:
        status = request["handle"].get_status()
        if status == self.status.RUNNING:
            return None
        self._read(request)
        self._live.remove(request)
        if status != self.status.FINISHED:
            raise SpecbuildError(f"{self.label}: a request ended {status.name} (cache too small?)")
        times = request["times"] or [time.perf_counter() - request["arrival"]]
        return Finished(request["ids"], times[0], times[-1], time.perf_counter() - request["arrival"])

    def counters(self) -> dict[str, int]:
        return {}


class OpenVINOStack(PeerStack):
    name = "OpenVINO GenAI"
    options = (
        PeerOption(
            "--openvino-model",
            "openvino_dirs",
            "Also time OpenVINO GenAI on this model directory (greedy and its prompt lookup; with --concurrency, its "
            "continuous batching); needs the openvino-genai package.",
        ),
    )

    def sequential(self, args: dict, threads: int | None, eos_ids: set[int]) -> list:
        return [
            OpenVINOTimer(d, threads, lookup) for d in model_dirs(args, "openvino_dirs") for lookup in (False, True)
        ]

    def load(self, args: dict, threads: int | None, max_num_seqs: int, max_new_tokens: int) -> list:
        return [OpenVINOLoad(d, threads, max_num_seqs, max_new_tokens) for d in model_dirs(args, "openvino_dirs")]


STACK = OpenVINOStack()
