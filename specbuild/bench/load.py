"""`specbuild bench --concurrency 1,4,16`: engines under load, as a closed loop of clients.

For each concurrency C (outer loop) and each engine (inner loop, so that the engines at one C are measured back to
back and share the machine's noise): a Scheduler with min(C, the engine's KV slots) slots gets C requests at once,
and whenever one finishes the next prompt is submitted, until every prompt is done (after a warm-up loop of C
requests of WARMUP_TOKENS tokens on the same scheduler, not counted). Per (engine, C): aggregate output tokens/s
(all output tokens / wall time from the first submission to the last finish), TTFT, inter-token latency (per
request: (last token - first token) / (tokens - 1), as vLLM and AIPerf define it) and request latency percentiles, τ
(accepted tokens per decode step over all requests), the share of steps that drafted, and how many outputs equal
those of the first `none` engine at the lowest concurrency. Each engine's cost curve (ms per call against rows per
call, runtime/speculation.py) bounds what batching can give on this machine: a `none` engine's ceiling at C is the
run's own prompt engine time plus full decode calls of min(C, slots) rows, at the curve's cost. OpenVINO GenAI's
ContinuousBatchingPipeline runs the same prompts through the same closed loop as a peer (--openvino-model), and
ONNX Runtime GenAI with a static batch (--ort-genai-model: at C, the requests waiting start together and run to
their end, the kernel ceiling of ONNX Runtime beside our curve) and transformers with a static batch
(--hf-model-dir: left-padded, one forward per token); each imported only then.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specbuild.bench import decoding
from specbuild.bench.sequential import engine_precision
from specbuild.errors import SpecbuildError
from specbuild.runtime.scheduler import Request, Scheduler

CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)
WARMUP_TOKENS = 4
OPENVINO_CACHE_GB = 2


@dataclasses.dataclass
class Finished:
    """One finished request of a closed loop; times in seconds after its submission."""

    output_ids: list[int]
    ttft_s: float
    last_token_s: float
    latency_s: float
    accepted_per_step: list[int] = dataclasses.field(default_factory=list)
    prefill_engine_s: float | None = None  # engine time of its prompt (our engines only)

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency (None for a request of one token)."""
        n = len(self.output_ids)
        return (self.last_token_s - self.ttft_s) / (n - 1) if n > 1 else None


def parse_concurrency(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (sorted, no repeats); anything else is a one-line SpecbuildError."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise SpecbuildError(f"--concurrency must be comma-separated integers >= 1 (e.g. 1,4,16), got {text!r}")
        values.append(int(part))
    return sorted(set(values))


# ---------------------------------------------------------------- load targets: submit / step / finished
class SchedulerLoad:
    """An engine's scheduler as a closed-loop target."""

    def __init__(self, engine, concurrency: int, max_new_tokens: int):
        self.scheduler = Scheduler(engine, max_batch_size=min(concurrency, engine.layout.max_batch_size))
        self.max_new_tokens = max_new_tokens

    def submit(self, ids: list[int], sampling):
        return self.scheduler.submit(Request(list(ids), max_new_tokens=self.max_new_tokens, sampling=sampling))

    def step(self) -> bool:
        return self.scheduler.step()

    def finished(self, handle) -> Finished | None:
        if not handle.finished:
            return None
        if handle.error is not None:
            raise handle.error
        last = handle.token_times[-1] if handle.token_times else handle.finished_at
        ttft = handle.first_token_at if handle.first_token_at is not None else handle.finished_at
        return Finished(
            list(handle.output_ids), ttft, last, handle.finished_at, list(handle.accepted_per_step),
            handle.prefill_engine_s,
        )  # fmt: skip

    def counters(self) -> dict[str, int]:
        """Decode steps so far that verified drafts and that decoded plainly (the speculation policy's choices)."""
        spec = self.scheduler.speculation
        return {
            "drafted_steps": spec.drafted_steps, "plain_steps": spec.plain_steps, "token_rows": spec.rows,
            "padded_rows": spec.padded_rows,
        }  # fmt: skip

    def prepare(self) -> None:
        """Measure the call costs the run's steps can need before it is timed (the speculation policy's)."""
        if self.scheduler.speculation.policy == "auto" and self.scheduler.engine.layout.step_tokens > 1:
            self.scheduler.engine.cost_curve().prepare(self.scheduler.batch.slots)


@dataclasses.dataclass
class LoopRun:
    done: list[Finished]  # in prompt order
    wall_s: float  # first submission to last finish
    most_in_flight: int
    steps: int  # target steps that did work


def closed_loop(target, prompts: list[list[int]], concurrency: int, sampling=None) -> LoopRun:
    """Every prompt through `target` with `concurrency` requests in flight (a new one as soon as one finishes);
    prompt i decodes with decoding.for_request(sampling, i)."""
    pending = list(enumerate(prompts))
    in_flight: dict[int, Any] = {}
    done: list[Finished | None] = [None] * len(prompts)
    most = steps = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            index, ids = pending.pop(0)
            in_flight[index] = target.submit(ids, decoding.for_request(sampling, index))
        most = max(most, len(in_flight))
        if not target.step():
            raise SpecbuildError(f"the load target stopped with {len(in_flight)} requests unfinished")
        steps += 1
        for index, handle in list(in_flight.items()):
            record = target.finished(handle)
            if record is not None:
                done[index] = record
                del in_flight[index]
    return LoopRun(done, time.perf_counter() - start, most, steps)


# ---------------------------------------------------------------- summaries
def _percentiles(values: list[float], name: str, qs=(50, 90, 99)) -> dict[str, float | None]:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return {f"{name}_p{q}_ms": (1000 * float(np.percentile(arr, q)) if arr.size else None) for q in qs}


def summarize_load(run: LoopRun) -> dict[str, Any]:
    done, wall_s = run.done, run.wall_s
    tokens = sum(len(r.output_ids) for r in done)
    steps = sum(len(r.accepted_per_step) for r in done)
    return {
        "requests": len(done),
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        **_percentiles([r.ttft_s for r in done], "ttft"),
        **_percentiles([r.itl_s for r in done], "itl"),
        **_percentiles([r.latency_s for r in done], "latency", qs=(50, 90)),
        "tau": sum(sum(r.accepted_per_step) for r in done) / steps if steps else None,
        "steps": run.steps,
        "most_in_flight": run.most_in_flight,
        "prefill_engine_s": sum(r.prefill_engine_s or 0.0 for r in done),
    }


def rss_mib() -> float:
    """The process's resident memory now (Linux), else its peak."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def kv_mib_per_slot(layout) -> float:
    """KV cache memory of one slot at the engine's full context (keys and values of every layer)."""
    per_position = 2 * layout.num_layers * layout.kv_heads * layout.head_dim * np.dtype(layout.kv_dtype).itemsize
    return per_position * layout.max_capacity / 2**20


def cost_curve_report(engine) -> dict[str, Any]:
    """The engine's measured call cost and its ms per call against rows per call (rows = sequences x tokens)."""
    curve = engine.cost_curve()
    slots = engine.layout.max_batch_size
    rows = [{"rows": r, "ms": ms, "ms_per_row": ms / r} for r, ms in curve.rows_curve(list(CURVE_ROWS), slots)]
    return {**curve.to_dict(), "slots": slots, "cached": curve.cached, "rows_curve": rows}


def plain_ceiling(engine, concurrency: int, row: dict) -> float:
    """Tokens/s of plain decoding if, after the prompts' own engine time (measured in the run), every decode step
    were a full call of min(C, slots) rows with no host time: what the engine's cost curve allows for this run."""
    rows = min(concurrency, engine.layout.max_batch_size)
    decode_steps = (row["tokens"] - row["requests"]) / rows  # the first token of each request comes from its prompt
    seconds = row["prefill_engine_s"] + decode_steps * engine.cost_curve().cost(rows, 1) / 1000
    return row["tokens"] / seconds if seconds > 0 else 0.0


class OpenVINOLoad:
    """OpenVINO GenAI's continuous batching (ContinuousBatchingPipeline, dynamic split-fuse) as a closed-loop target,
    on the same ids; TTFT and inter-token times from when each step's new tokens are read. Needs the
    `openvino-genai` package and an OpenVINO model directory (see benchmark.OpenVINOTimer)."""

    def __init__(self, model_dir, threads: int | None, max_num_seqs: int, max_new_tokens: int):
        from specbuild.bench.sequential import import_openvino, openvino_compute

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


class StaticBatch:
    """A peer without continuous batching, run as its users batch prompts: the requests waiting when no batch runs
    start together, and the batch runs until every one of them has its tokens (EOS or max_new_tokens); a request
    submitted meanwhile waits for the next batch. Each step makes one token of every row (the first one's includes
    the prompts), read when it is made. Subclasses start a batch (`_start`) and make its next tokens (`_next`); a
    sampled batch draws with the settings of its first request (a static batch has one generator)."""

    def __init__(self, eos: set[int], max_new_tokens: int):
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self._waiting: list[dict] = []
        self._batch: list[dict] = []

    def submit(self, ids: list[int], sampling) -> dict:
        request = {"ids": ids, "out": [], "times": [], "arrival": time.perf_counter(), "done": False}
        request["sampling"] = sampling
        self._waiting.append(request)
        return request

    def step(self) -> bool:
        if not self._batch:
            if not self._waiting:
                return False
            self._batch, self._waiting = self._waiting, []
            self._start(self._batch)
        tokens, now = self._next(), time.perf_counter()
        for request, token in zip(self._batch, tokens):
            if not request["done"]:
                request["out"].append(int(token))
                request["times"].append(now - request["arrival"])
                request["done"] = int(token) in self.eos or len(request["out"]) >= self.max_new_tokens
        if all(r["done"] for r in self._batch):
            self._batch = []
            self._start([])
        return True

    def _start(self, requests: list[dict]) -> None:
        """Set up a batch of `requests` (none: drop the finished batch's state)."""
        raise NotImplementedError

    def _next(self) -> list[int]:
        """The batch's next token, one per row."""
        raise NotImplementedError

    def finished(self, request: dict) -> Finished | None:
        if not request["done"]:
            return None
        times = request["times"]
        return Finished(request["out"], times[0], times[-1], times[-1])

    def counters(self) -> dict[str, int]:
        return {}


class OrtGenAIBatch(StaticBatch):
    """ONNX Runtime GenAI with a static batch, the reference for what ONNX Runtime's kernels give a batch on this CPU
    (GenAI has no continuous batching on CPU): the prompts padded on the right with its pad id (GenAI's convention:
    with left padding a shorter prompt's output changes). Greedy on the same ids. Needs the `onnxruntime-genai`
    package and a directory made by its model builder (see sequential.OrtGenAITimer)."""

    def __init__(self, model_dir, threads: int | None, max_new_tokens: int):
        from specbuild.bench.sequential import genai_min_length, open_genai_model

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


class HFBatch(StaticBatch):
    """transformers with a static batch, as a transformers user runs many prompts (`generate` on a left-padded
    batch, its documented way): the prompts left-padded with an attention mask and their own positions, one forward
    per token, fp32, on the same ids (--hf-model-dir)."""

    def __init__(self, model_dir, threads: int | None, max_new_tokens: int):
        import torch

        from specbuild.bench.sequential import HFTimer

        self.torch = torch
        self.model = HFTimer.load(model_dir, threads)
        eos = self.model.generation_config.eos_token_id
        super().__init__(set(eos if isinstance(eos, list) else [] if eos is None else [eos]), max_new_tokens)
        pad = self.model.generation_config.pad_token_id
        self.pad = int(pad if pad is not None else next(iter(sorted(self.eos)), 0))
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # as generate's prefill
        self.label = f"HF transformers static batch {Path(model_dir).name}"
        self._state: dict | None = None

    def _start(self, requests: list[dict]) -> None:
        if not requests:
            self._state = None
            return
        torch = self.torch
        longest = max(len(r["ids"]) for r in requests)
        tokens = torch.full((len(requests), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(requests), longest), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding: every prompt ends at the last column
            tokens[row, longest - len(request["ids"]) :] = torch.tensor(request["ids"])
            mask[row, longest - len(request["ids"]) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self._state = {"tokens": tokens, "mask": mask, "positions": positions, "cache": None}
        self._state["pick"] = decoding.hf_sampler(requests[0]["sampling"])

    def _next(self) -> list[int]:
        torch, state = self.torch, self._state
        with torch.inference_mode():
            out = self.model(
                input_ids=state["tokens"],  # [B, L] the padded prompts, then [B, 1] each step's tokens
                attention_mask=state["mask"],  # [B, past + L]
                position_ids=state["positions"],  # [B, L]
                use_cache=True,
                **{self._cache_arg: state["cache"]},
                **self._last_logits,
            )
        tokens = state["pick"](out.logits[:, -1])  # [B]
        state["cache"] = getattr(out, self._cache_arg)
        state["tokens"] = tokens.unsqueeze(1)
        state["positions"] = state["positions"][:, -1:] + 1
        state["mask"] = torch.cat([state["mask"], torch.ones_like(state["tokens"])], dim=1)
        return tokens.tolist()


# ---------------------------------------------------------------- the run
def measure(target, prompts: list[list[int]], concurrency: int, max_new_tokens: int, sampling=None):
    """A short warm-up loop (every batch size up to C seen once), then the measured closed loop: its row and outputs."""
    target.max_new_tokens = WARMUP_TOKENS
    closed_loop(target, [prompts[i % len(prompts)] for i in range(concurrency)], concurrency, sampling)
    target.max_new_tokens = max_new_tokens
    if hasattr(target, "prepare"):
        target.prepare()
    before = target.counters()
    run = closed_loop(target, prompts, concurrency, sampling)
    row = {**summarize_load(run), "rss_mib": rss_mib()}
    counts = {name: value - before[name] for name, value in target.counters().items()}
    if counts:
        decided = counts["drafted_steps"] + counts["plain_steps"]
        row.update(counts, drafted_share=counts["drafted_steps"] / decided if decided else 0.0)
        row["padding_share"] = counts["padded_rows"] / counts["token_rows"] if counts["token_rows"] else 0.0
    return row, [r.output_ids for r in run.done]


def run_load(
    engines: list,
    labels: list[str],
    prompts: list[list[int]],
    concurrency: list[int],
    max_new_tokens: int,
    peers: list = (),
    log: Callable[[str], None] = print,
    repeats: int = 1,
    sampling=None,
) -> dict[str, dict]:
    """{str(C): {"engines": {label: row}, "peers": {label: row}}}, concurrency outermost; with `repeats` > 1 every
    engine and peer runs that many rounds at each C, in turns (round 1 of each, then round 2, ...: a slow spell of
    the machine falls on all of them), and a row is its median round; rows compared afterwards (compare_rows)."""
    results: dict[str, dict] = {}
    outputs: dict[tuple[str, int], list] = {}
    for c in concurrency:
        rounds: dict[tuple[str, str], list[tuple[dict, list]]] = {}
        for r in range(repeats):
            of_round = f" (round {r + 1}/{repeats})" if repeats > 1 else ""
            for label, engine in zip(labels, engines):
                log(f"concurrency {c}: {label}{of_round}")
                target = SchedulerLoad(engine, c, max_new_tokens)
                row, outs = measure(target, prompts, c, max_new_tokens, sampling)
                row["slots"] = target.scheduler.batch.slots
                rounds.setdefault(("engines", label), []).append((row, outs))
            for peer in peers:
                log(f"concurrency {c}: {peer.label}{of_round}")
                rounds.setdefault(("peers", peer.label), []).append(measure(peer, prompts, c, max_new_tokens, sampling))
        results[str(c)] = {"engines": {}, "peers": {}}
        for (kind, label), runs in rounds.items():
            results[str(c)][kind][label], outputs[label, c] = median_round(runs)
    compare_rows(results, outputs, engines, labels)
    return results


def median_round(runs: list[tuple[dict, list]]) -> tuple[dict, list]:
    """The round with the median tokens/s (the lower middle one of an even count), with every round's tokens/s and
    whether every round gave the same outputs."""
    ranked = sorted(runs, key=lambda run: run[0]["tokens_per_s"])
    row, outs = ranked[(len(ranked) - 1) // 2]
    if len(runs) > 1:
        row["rounds_tokens_per_s"] = [run[0]["tokens_per_s"] for run in runs]
        row["rounds_same_outputs"] = all(o == runs[0][1] for _, o in runs)
    return row, outs


def compare_rows(results: dict[str, dict], outputs: dict, engines: list, labels: list[str]) -> None:
    """Per row: outputs equal to the first `none` engine's at the lowest concurrency (and to the own-precision
    `none` engine's), speed-up over the own-precision `none` engine at the same C (peers: over the first `none`),
    scaling over the same row at the lowest C, tokens/s against the first peer at the same C, and for `none`
    engines the cost curve's ceiling and the share of it achieved."""
    plain = [_is_plain(e) for e in engines]
    precision = [engine_precision(e) for e in engines]
    own_none = {
        label: next((labels[i] for i in range(len(engines)) if plain[i] and precision[i] == mine), None)
        for label, mine in zip(labels, precision)
    }
    baseline = next((lab for lab, p in zip(labels, plain) if p), None)
    lowest = min(int(c) for c in results)
    for c, res in results.items():
        first_peer = next(iter(res["peers"].values()), None)
        rows = [(label, row, "engines", own_none[label]) for label, row in res["engines"].items()]
        rows += [(label, row, "peers", baseline) for label, row in res["peers"].items()]
        for label, row, kind, ref in rows:
            got = outputs[label, int(c)]
            if baseline is not None:
                row["matches_baseline"] = _matches(got, outputs[baseline, lowest])
            if ref not in (None, baseline):
                row["own_none"] = ref
                row["matches_own_none"] = _matches(got, outputs[ref, lowest])
            row["speedup"] = _ratio(row, res["engines"].get(ref))
            row["scaling"] = _ratio(row, results[str(lowest)][kind][label])
            row["vs_peer"] = _ratio(row, first_peer) if row is not first_peer else None
        for label, engine, is_plain in zip(labels, engines, plain):
            if is_plain:
                row = res["engines"][label]
                row["ceiling_tokens_per_s"] = plain_ceiling(engine, int(c), row)
                row["ceiling_share"] = row["tokens_per_s"] / row["ceiling_tokens_per_s"]


def _matches(got: list, want: list) -> int:
    return sum(a == b for a, b in zip(got, want))


def _ratio(row: dict, other: dict | None) -> float | None:
    return row["tokens_per_s"] / other["tokens_per_s"] if other and other["tokens_per_s"] else None


def interleaved_prompts(engine, prompt_sets: list[str], num_prompts: int) -> list[list[int]]:
    """Token ids (the engine's tokenizer) of every set's prompts, the sets interleaved (mixed lengths in flight
    together)."""
    from specbuild.prompts import is_chat, load_prompt_set

    codec = engine.codec
    per_set = []
    for name in prompt_sets:
        texts = load_prompt_set(name, num_prompts)
        chat = is_chat(name) and codec.chat_template is not None  # a base model (no template) gets the raw text
        per_set.append([codec.prompt_ids(t, chat) for t in texts])
    longest = max(len(group) for group in per_set)
    return [group[i] for i in range(longest) for group in per_set if i < len(group)]


def run_load_benchmark(
    engine_dirs: list[str | Path],
    prompt_sets: list[str],
    concurrency: list[int],
    num_prompts: int = 8,
    max_new_tokens: int = 128,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    allow_lossy: bool = False,
    openvino_dirs: list[str | Path] = (),
    repeats: int = 1,
    ort_genai_dirs: list[str | Path] = (),
    hf_model_dir: str | Path | None = None,
    sampling=None,
) -> dict[str, Any]:
    """`specbuild bench --concurrency`: the report (settings, engines with their cost curves, rows per C); sampling:
    the run's SamplingParams (None: greedy; request i seeded with its seed + i)."""
    from specbuild.bench.sequential import load_engines
    from specbuild.runtime.row_invariance import cpu_description

    engines, labels = load_engines(engine_dirs, max_new_tokens, threads, allow_lossy)
    prompts = interleaved_prompts(engines[0], prompt_sets, num_prompts)
    peers = [OpenVINOLoad(d, threads, max(concurrency), max_new_tokens) for d in openvino_dirs]
    peers += [OrtGenAIBatch(d, threads, max_new_tokens) for d in ort_genai_dirs]
    peers += [HFBatch(hf_model_dir, threads, max_new_tokens)] if hf_model_dir else []
    log("measuring each engine's call cost")
    curves = [cost_curve_report(e) for e in engines]
    results = run_load(engines, labels, prompts, concurrency, max_new_tokens, peers, log, repeats, sampling)
    return {
        "settings": {
            "prompt_sets": prompt_sets,
            "num_prompts": num_prompts,
            "requests": len(prompts),
            "max_new_tokens": max_new_tokens,
            "concurrency": concurrency,
            "threads": threads,
            "repeats": repeats,
            "openvino_dirs": [str(d) for d in openvino_dirs],
            "ort_genai_dirs": [str(d) for d in ort_genai_dirs],
            "hf_model_dir": str(hf_model_dir) if hf_model_dir else None,
            "sampling": decoding.to_dict(sampling),
            "cpu": cpu_description(),
        },
        "engines": [
            {
                "label": label,
                "path": str(e.path),
                "mode": e.manifest["speculative_mode"],
                "precision": list(engine_precision(e)),
                "max_batch_size": e.layout.max_batch_size,
                "kv_mib_per_slot": kv_mib_per_slot(e.layout),
                "lossless": e.lossless,
                "cost_curve": curve,
            }
            for label, e, curve in zip(labels, engines, curves)
        ],
        "baseline": next((lab for lab, e in zip(labels, engines) if _is_plain(e)), None),
        "load": results,
    }


def _is_plain(engine) -> bool:
    from specbuild.modes.registry import get_mode

    return get_mode(engine.manifest["speculative_mode"]).baseline


# ---------------------------------------------------------------- rendering
def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _same(row: dict) -> str:
    same = f"{row['matches_baseline']}/{row['requests']}" if "matches_baseline" in row else "-"
    if "matches_own_none" in row:
        same += f" (own {row['matches_own_none']}/{row['requests']})"
    if row.get("rounds_same_outputs") is False:
        same += " rounds differ"
    return same


def load_table(report: dict[str, Any]):
    from rich.markup import escape
    from rich.table import Table

    settings = report["settings"]
    lowest = min(settings["concurrency"])
    table = Table(
        title=f"closed loop: {settings['requests']} requests ({', '.join(settings['prompt_sets'])}), "
        f"{decoding.describe(settings.get('sampling'))}, max "
        f"{settings['max_new_tokens']} new tokens, C in flight (baseline {report['baseline'] or '-'}) on "
        f"{settings.get('cpu', 'this CPU')}",
        title_justify="left",
    )
    cols = ["C", "engine", "tok/s", "vs none", f"vs C={lowest}", "vs peer", "TTFT ms p50/p99", "ITL ms p50/p99"]
    cols += ["τ", "drafted %", "pad %", "ceiling %", "steps", "RSS MiB", "same"]
    for col in cols:
        table.add_column(col, justify="left" if col == "engine" else "right")
    for c, res in report["load"].items():
        for label, r in [*res["engines"].items(), *res["peers"].items()]:
            table.add_row(
                c,
                escape(label),
                _tokens_per_s(r),
                _fmt(r.get("speedup"), ".2f"),
                _fmt(r.get("scaling"), ".2f"),
                _fmt(r.get("vs_peer"), ".2f"),
                f"{_fmt(r['ttft_p50_ms'], '.0f')}/{_fmt(r['ttft_p99_ms'], '.0f')}",
                f"{_fmt(r['itl_p50_ms'], '.1f')}/{_fmt(r['itl_p99_ms'], '.1f')}",
                _fmt(r.get("tau"), ".2f"),
                _fmt(r.get("drafted_share"), ".0f", 100),
                _fmt(r.get("padding_share"), ".0f", 100),
                _fmt(r.get("ceiling_share"), ".0f", 100),
                str(r["steps"]),
                _fmt(r["rss_mib"], ".0f"),
                _same(r),
            )
        table.add_section()
    return table


def _tokens_per_s(row: dict) -> str:
    """The row's tokens/s, and the range of its rounds where it had several."""
    rounds = row.get("rounds_tokens_per_s")
    text = _fmt(row["tokens_per_s"], ".1f")
    return f"{text} ({min(rounds):.0f}-{max(rounds):.0f})" if rounds else text


def curve_table(report: dict[str, Any]):
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title="call cost: ms per call (ms per row) against rows per call (sequences x tokens, up to the KV slots)",
        title_justify="left",
    )
    table.add_column("engine", justify="left")
    table.add_column("slots", justify="right")
    table.add_column("KV MiB/slot", justify="right")
    for r in CURVE_ROWS:
        table.add_column(str(r), justify="right")
    for engine in report["engines"]:
        curve = engine["cost_curve"]
        cells = [f"{p['ms']:.1f} ({p['ms_per_row']:.2f})" for p in curve["rows_curve"]]
        table.add_row(escape(engine["label"]), str(curve["slots"]), f"{engine['kv_mib_per_slot']:.1f}", *cells)
    return table


def render_load(report: dict[str, Any], console=None) -> None:
    if console is None:
        from rich.console import Console

        console = Console()
        console = console if console.is_terminal else Console(width=200)  # a pipe or a file: no wrapped rows
    console.print(load_table(report))
    console.print(curve_table(report))
    for c, res in report["load"].items():
        for label, r in res["engines"].items():
            if "ceiling_tokens_per_s" in r:
                console.print(
                    f"C={c} {label}: ceiling {r['ceiling_tokens_per_s']:.1f} tok/s (the prompts' engine time, then "
                    f"full calls of {r['slots']} rows, no host time), achieved {100 * r['ceiling_share']:.0f} %",
                    markup=False,
                )
