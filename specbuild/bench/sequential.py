"""`specbuild bench`: generation (greedy, or sampled: bench/decoding.py) over prompt sets on several engines, and
optionally on other stacks, measured in one run with every engine and peer interleaved per prompt so that they share
the machine's noise.

Per prompt set and engine: tokens/s (overall and decode), TTFT, τ (mean tokens per decode step, bonus included),
speed-up against the first plain-decoding (`none`) engine, η = speed-up / τ, `vs_fastest` (tokens/s relative to
the fastest other row of the run), host overhead per decode step (ms and as a share of engine time), and whether
the output equals, token for token, that of the first `none` engine and of the `none` engine of the same weights
and activations. Peers, timed on the same token ids: transformers' `generate` (greedy and prompt lookup,
--hf-model-dir), ONNX Runtime GenAI (greedy and n-gram, --ort-genai-model) and OpenVINO GenAI (greedy and prompt
lookup, --openvino-model). The report records the CPU, and each engine's exactness verdict on it. `--context-sweep`
times host and engine ms/step of the first engine at ~64 vs ~1024 tokens of context.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specbuild import engine_format as ef
from specbuild.bench import decoding
from specbuild.errors import SpecbuildError
from specbuild.host_memory import available_bytes
from specbuild.modes.registry import get_mode
from specbuild.prompts import is_chat, load_prompt_set

SWEEP_CONTEXTS = (64, 1024)
SWEEP_MIN_SEQ_LEN = 1100
SWEEP_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens and verifies them "
    "in one call of the target model, so every accepted draft saves a full forward pass. "
)
WARMUP_PROMPT = "Hello, world"


@dataclasses.dataclass
class Sample:
    """One timed generation."""

    output_ids: list[int]
    steps: int
    accepted: int  # tokens accepted over all decode steps (bonus included)
    total_s: float
    ttft_s: float
    decode_engine_s: float  # engine time of the decode steps (prefill excluded)

    @property
    def tokens(self) -> int:
        return len(self.output_ids)

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.ttft_s, 0.0)

    @property
    def decode_host_s(self) -> float:
        return max(self.decode_s - self.decode_engine_s, 0.0)


def timed_generate(
    engine, input_ids: list[int], max_new_tokens: int, ignore_eos: bool = False, sampling=None
) -> Sample:
    """One generation (greedy unless `sampling`); the runtime reports its engine time (prefill separately) and the
    host time."""
    eos = engine.eos_ids
    if ignore_eos:
        engine.eos_ids = set()
    try:
        res = engine.generate(input_ids=input_ids, max_new_tokens=max_new_tokens, sampling=sampling, decode_text=False)
    finally:
        engine.eos_ids = eos
    return Sample(
        output_ids=list(res.output_ids),
        steps=res.steps,
        accepted=int(sum(res.accepted_per_step)),
        total_s=res.total_s,
        ttft_s=res.ttft_s,
        decode_engine_s=res.engine_s - res.prefill_engine_s,
    )


def summarize(samples: list[Sample], baseline: list[Sample] | None = None) -> dict[str, Any]:
    tokens = sum(s.tokens for s in samples)
    total = sum(s.total_s for s in samples)
    decode_tokens = sum(max(s.tokens - 1, 0) for s in samples)
    decode_s = sum(s.decode_s for s in samples)
    steps = sum(s.steps for s in samples)
    host = sum(s.decode_host_s for s in samples)
    engine = sum(s.decode_engine_s for s in samples)
    out = {
        "prompts": len(samples),
        "tokens": tokens,
        "steps": steps,
        "tokens_per_s": tokens / total if total else 0.0,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "ttft_ms": 1000 * sum(s.ttft_s for s in samples) / len(samples),
        "tau": sum(s.accepted for s in samples) / steps if steps else 0.0,
        "host_ms_per_step": 1000 * host / steps if steps else 0.0,
        "host_share": host / engine if engine else 0.0,
        "engine_ms_per_step": 1000 * engine / steps if steps else 0.0,
    }
    if baseline is not None:
        out["matches_baseline"] = sum(a.output_ids == b.output_ids for a, b in zip(samples, baseline))
    return out


class HFTimer:
    """transformers' `generate` on the same ids (greedy or sampled): full generation and a 1-token generate for
    TTFT; with `prompt_lookup` N, its prompt lookup decoding (`prompt_lookup_num_tokens=N`), what a transformers user
    would turn on for speculation without a draft model."""

    PROMPT_LOOKUP_TOKENS = 10

    def __init__(self, model, eos_ids, prompt_lookup: int | None = None, assistant=None, assistant_name: str = ""):
        import torch

        self.torch = torch
        self.model = model
        self.eos_ids = sorted(eos_ids) or None
        self.prompt_lookup = prompt_lookup
        self.assistant = assistant  # a draft model: transformers' assisted generation
        self.label = "HF transformers" + (f" prompt lookup {prompt_lookup}" if prompt_lookup else "")
        if assistant is not None:
            self.label = f"HF transformers assisted generation ({assistant_name})"
        self.ngram = bool(prompt_lookup)

    @staticmethod
    def load_assistant(assistant_dir, target):
        """The draft model in `assistant_dir` for transformers' assisted generation (a mode's own draft format where
        one claims the directory, else any transformers model directory)."""
        from transformers import AutoModelForCausalLM

        from specbuild.modes.registry import load_object, modes

        if not Path(assistant_dir).is_dir():
            raise SpecbuildError(f"{assistant_dir}: --hf-assistant-dir does not exist")
        for spec in modes().values():
            if spec.hf_assistant:
                model = load_object(spec.hf_assistant)(Path(assistant_dir), target)
                if model is not None:
                    return model
        return AutoModelForCausalLM.from_pretrained(str(assistant_dir), dtype=target.dtype).eval()

    @staticmethod
    def load(model_dir, threads: int | None):
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        if not Path(model_dir).is_dir():
            raise SpecbuildError(f"{model_dir}: --hf-model-dir does not exist")
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def _generate(self, ids: list[int], max_new_tokens: int, sampling=None):
        torch = self.torch
        x = torch.tensor([ids], dtype=torch.long)
        extra = {"prompt_lookup_num_tokens": self.prompt_lookup} if self.prompt_lookup else {}
        if self.assistant is not None:
            extra["assistant_model"] = self.assistant
        if not decoding.is_greedy(sampling):
            torch.manual_seed(sampling.seed)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                **decoding.hf_generate_kwargs(sampling),
                eos_token_id=self.eos_ids,
                pad_token_id=self.eos_ids[0] if self.eos_ids else None,
                **extra,
            )
            return time.perf_counter() - start, out[0, len(ids) :].tolist()

    def sample(self, ids: list[int], max_new_tokens: int, sampling=None) -> Sample:
        ttft, _ = self._generate(ids, 1, sampling)
        total, out = self._generate(ids, max_new_tokens, sampling)
        return Sample(output_ids=out, steps=0, accepted=0, total_s=total, ttft_s=ttft, decode_engine_s=0.0)


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


def _label(path: Path, mode: str, used: set[str]) -> str:
    label = f"{path.name} ({mode})"
    while label in used:
        label += "'"
    used.add(label)
    return label


def engine_precision(engine) -> tuple:
    """(weights, activations, KV cache) of an engine: engines that differ in any give other tokens."""
    weights = engine.manifest.get("weights", {})
    kv_cache = weights.get(ef.GRAPH_KV_CACHE_DTYPE, ef.KV_CACHE_FLOAT)
    return weights.get("precision"), weights.get("activations", "float"), kv_cache


def load_engines(engine_dirs, max_new_tokens: int, threads: int | None, allow_lossy: bool) -> tuple[list, list[str]]:
    """The engines to benchmark and their row labels, after the checks every benchmark makes."""
    from specbuild.runtime.engine import Engine

    if not engine_dirs:
        raise SpecbuildError("give at least one --engine-dir")
    if max_new_tokens < 1:
        raise SpecbuildError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_engines_fit(engine_dirs, available_bytes())
    engines, labels, used = [], [], set()
    for d in engine_dirs:
        engine = Engine(d, threads=threads, allow_lossy=allow_lossy)
        engines.append(engine)
        labels.append(_label(Path(d), engine.manifest["speculative_mode"], used))
    return engines, labels


def check_engines_fit(engine_dirs, available: int | None) -> None:
    """The engines are loaded side by side (every prompt runs through each in turn) and ONNX Runtime holds at least
    their files while they are: refuse, before loading any, engines whose files exceed the `available` bytes."""
    sizes = {str(d): sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()) for d in engine_dirs}
    total = sum(sizes.values())
    if available is None or total <= available:
        return
    largest = max(sizes, key=sizes.get)
    raise SpecbuildError(
        f"--engine-dir: the {len(sizes)} engines take {total / 1e9:.1f} GB together, more than the "
        f"{available / 1e9:.1f} GB this machine has available, and a benchmark holds them all at once: run fewer "
        f"engines per benchmark (the largest, {largest}, takes {sizes[largest] / 1e9:.1f} GB)"
    )


def context_sweep(engine, max_new_tokens: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Host and engine ms per decode step at ~64 and ~1024 tokens of context (EOS ignored)."""
    if engine.max_seq_len < SWEEP_MIN_SEQ_LEN:
        return {"skipped": f"engine max_seq_len {engine.max_seq_len} < {SWEEP_MIN_SEQ_LEN}"}
    try:
        base = engine.codec.encode(SWEEP_TEXT)
    except SpecbuildError:
        base = list(range(3, 3 + 97))
    results = {}
    for context in SWEEP_CONTEXTS:
        ids = (base * (context // len(base) + 1))[:context]
        log(f"context sweep: {context} tokens")
        s = timed_generate(engine, ids, max_new_tokens, ignore_eos=True)
        results[str(context)] = {
            "context_tokens": context,
            "steps": s.steps,
            "host_ms_per_step": 1000 * s.decode_host_s / s.steps if s.steps else 0.0,
            "engine_ms_per_step": 1000 * s.decode_engine_s / s.steps if s.steps else 0.0,
            "ttft_ms": 1000 * s.ttft_s,
        }
    return results


def run_benchmark(
    engine_dirs: list[str | Path],
    prompt_sets: list[str],
    num_prompts: int = 8,
    max_new_tokens: int = 128,
    hf_model_dir: str | Path | None = None,
    threads: int | None = None,
    sweep: bool = False,
    log: Callable[[str], None] = print,
    ort_genai_dirs: list[str | Path] = (),
    allow_lossy: bool = False,
    openvino_dirs: list[str | Path] = (),
    hf_assistant_dir: str | Path | None = None,
    sampling=None,
) -> dict[str, Any]:
    """sampling: the run's SamplingParams (None: greedy); prompt i is seeded with its seed + i (bench/decoding.py)."""
    from specbuild.runtime.row_invariance import cpu_description

    engines, labels = load_engines(engine_dirs, max_new_tokens, threads, allow_lossy)
    prompts = {name: load_prompt_set(name, num_prompts) for name in prompt_sets}
    plain = [get_mode(e.manifest["speculative_mode"]).baseline for e in engines]
    base_idx = next((i for i, e in enumerate(engines) if plain[i]), None)
    # an engine's reference is the none engine of the same precision (int8 activations or cache change output)
    precision = [engine_precision(e) for e in engines]
    own_none = [next((i for i in range(len(engines)) if plain[i] and precision[i] == p), None) for p in precision]
    codec = engines[0].codec
    peers: list = []
    if hf_model_dir:
        model = HFTimer.load(hf_model_dir, threads)
        peers += [HFTimer(model, engines[0].eos_ids, n) for n in (None, HFTimer.PROMPT_LOOKUP_TOKENS)]
        if hf_assistant_dir:
            assistant = HFTimer.load_assistant(hf_assistant_dir, model)
            peers.append(
                HFTimer(model, engines[0].eos_ids, assistant=assistant, assistant_name=Path(hf_assistant_dir).name)
            )
    peers += [OrtGenAITimer(d, threads, ngram) for d in ort_genai_dirs for ngram in (False, True)]
    peers += [OpenVINOTimer(d, threads, lookup) for d in openvino_dirs for lookup in (False, True)]
    log("warming up")
    warm = codec.encode(WARMUP_PROMPT)
    for eng in engines:
        timed_generate(eng, warm, 4)
    for peer in peers:
        peer.sample(warm, 4)

    report: dict[str, Any] = {
        "settings": {
            "prompt_sets": prompt_sets,
            "num_prompts": num_prompts,
            "max_new_tokens": max_new_tokens,
            "threads": threads,
            "hf_model_dir": str(hf_model_dir) if hf_model_dir else None,
            "hf_assistant_dir": str(hf_assistant_dir) if hf_assistant_dir else None,
            "ort_genai_dirs": [str(d) for d in ort_genai_dirs],
            "openvino_dirs": [str(d) for d in openvino_dirs],
            "sampling": decoding.to_dict(sampling),
            "cpu": cpu_description(),  # speed and exactness are properties of this machine
        },
        "engines": [
            {
                "label": lab,
                "path": str(e.path),
                "mode": e.manifest["speculative_mode"],
                "dtype": e.manifest["dtype"],
                "max_seq_len": e.max_seq_len,
                "lossless": e.lossless,  # on this machine (engine.yaml's claim, checked at load)
                "exactness": e.exactness.to_dict(),
            }
            for lab, e in zip(labels, engines)
        ],
        "baseline": labels[base_idx] if base_idx is not None else None,
        "results": {},
    }
    for name, texts in prompts.items():
        samples: list[list[Sample]] = [[] for _ in engines]
        peer_samples: list[list[Sample]] = [[] for _ in peers]
        for i, text in enumerate(texts):
            ids = codec.prompt_ids(text, is_chat(name) and codec.chat_template is not None)
            log(f"{name} {i + 1}/{len(texts)} ({len(ids)} prompt tokens)")
            request = decoding.for_request(sampling, i)
            for k, eng in enumerate(engines):
                samples[k].append(timed_generate(eng, ids, max_new_tokens, sampling=request))
            for k, peer in enumerate(peers):
                peer_samples[k].append(peer.sample(ids, max_new_tokens, request))
        base = samples[base_idx] if base_idx is not None else None
        rows = {lab: summarize(s, base) for lab, s in zip(labels, samples)}
        for k, own in enumerate(own_none):  # lossless is relative to the none engine of the same weight precision
            if own is not None and own != base_idx:
                rows[labels[k]]["own_none"] = labels[own]
                rows[labels[k]]["matches_own_none"] = sum(
                    a.output_ids == b.output_ids for a, b in zip(samples[k], samples[own])
                )
        set_report: dict[str, Any] = {"engines": rows}
        base_tps = rows[labels[base_idx]]["tokens_per_s"] if base_idx is not None else None
        set_report["peers"] = {}
        for peer, peer_runs in zip(peers, peer_samples):
            row = summarize(peer_runs, base)
            for key in ("host_ms_per_step", "host_share", "engine_ms_per_step"):
                row.pop(key)
            if not peer.ngram or not row["steps"]:  # transformers does not say how many steps it took
                row.pop("tau")
            row.pop("steps")
            row["speedup"] = row["tokens_per_s"] / base_tps if base_tps else None
            set_report["peers"][peer.label] = row
        add_relative_speed(rows, labels[base_idx] if base_idx is not None else None, set_report["peers"])
        report["results"][name] = set_report
    if sweep:
        report["context_sweep"] = {"engine": labels[0], **context_sweep(engines[0], max_new_tokens, log)}
    return report


def add_relative_speed(rows: dict[str, dict], baseline: str | None, peers: dict[str, dict] | None = None) -> None:
    """Per engine row: `speedup` over the baseline (plain decoding) engine, η = speedup / τ, and `vs_fastest`, the
    tokens/s ratio to the fastest row of the run other than itself (engines and peers alike; 1.05 = 5 % faster than
    the best alternative). Peer rows get `vs_fastest` too."""
    base_tps = rows[baseline]["tokens_per_s"] if baseline else None
    everyone = {**rows, **(peers or {})}
    for label, row in everyone.items():
        if label in rows:
            row["speedup"] = row["tokens_per_s"] / base_tps if base_tps else None
            row["eta"] = row["speedup"] / row["tau"] if row["speedup"] and row["tau"] else None
        others = [r["tokens_per_s"] for other, r in everyone.items() if other != label]
        row["vs_fastest"] = row["tokens_per_s"] / max(others) if others and max(others) > 0 else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def make_console():
    """A rich Console; when stdout is not a terminal (a pipe, a file), wide enough that tables do not wrap."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _same(row: dict[str, Any]) -> str:
    """Outputs equal to the baseline's, and to the own-precision none engine's when that is another engine."""
    same = f"{row['matches_baseline']}/{row['prompts']}" if "matches_baseline" in row else "-"
    if "matches_own_none" in row:
        same += f" (own none {row['matches_own_none']}/{row['prompts']})"
    return same


def render(report: dict[str, Any], console=None) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = console or make_console()
    settings = report["settings"]
    for name, res in report["results"].items():
        table = Table(
            title=f"{name}: {settings['num_prompts']} prompts, {decoding.describe(settings.get('sampling'))}, max "
            f"{settings['max_new_tokens']} new tokens "
            f"(baseline {report['baseline'] or '-'}) on {settings.get('cpu', 'this CPU')}",
            title_justify="left",
        )
        cols = ["engine", "tok/s", "decode tok/s", "TTFT ms", "τ", "speed-up", "η", "vs fastest other"]
        cols += ["host ms/step", "host %", "same"]
        for col in cols:
            table.add_column(col, justify="left" if col == "engine" else "right")
        for label, r in res["engines"].items():
            table.add_row(
                escape(label),
                _fmt(r["tokens_per_s"], ".1f"),
                _fmt(r["decode_tokens_per_s"], ".1f"),
                _fmt(r["ttft_ms"], ".0f"),
                _fmt(r["tau"], ".2f"),
                _fmt(r.get("speedup"), ".2f"),
                _fmt(r.get("eta"), ".2f"),
                _fmt(r.get("vs_fastest"), ".2f"),
                _fmt(r["host_ms_per_step"], ".2f"),
                _fmt(100 * r["host_share"], ".1f"),
                _same(r),
            )
        for label, r in (res.get("peers") or {}).items():
            table.add_row(
                escape(label),
                _fmt(r["tokens_per_s"], ".1f"),
                _fmt(r["decode_tokens_per_s"], ".1f"),
                _fmt(r["ttft_ms"], ".0f"),
                _fmt(r.get("tau"), ".2f"),
                _fmt(r.get("speedup"), ".2f"),
                "-",
                _fmt(r.get("vs_fastest"), ".2f"),
                *["-"] * 2,
                f"{r['matches_baseline']}/{r['prompts']}" if "matches_baseline" in r else "-",
            )
        console.print(table)
    for engine in report.get("engines", []):
        exact = engine.get("exactness") or {}
        if exact.get("min_rows", 1) > 1 or not engine.get("lossless", True):
            console.print(f"{escape(engine['label'])}: {'lossless' if engine['lossless'] else 'LOSSY'}, "
                          f"{escape(exact.get('verified', ''))}")  # fmt: skip
    sweep = report.get("context_sweep")
    if sweep:
        if "skipped" in sweep:
            console.print(f"context sweep skipped: {sweep['skipped']}")
            return
        table = Table(title=f"context sweep: {escape(sweep['engine'])}", title_justify="left")
        for col in ("context tokens", "steps", "host ms/step", "engine ms/step", "TTFT ms"):
            table.add_column(col, justify="right")
        for r in sweep.values():
            if isinstance(r, dict):
                table.add_row(
                    str(r["context_tokens"]),
                    str(r["steps"]),
                    f"{r['host_ms_per_step']:.2f}",
                    f"{r['engine_ms_per_step']:.2f}",
                    f"{r['ttft_ms']:.0f}",
                )
        console.print(table)
