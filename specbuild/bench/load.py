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
run's own prompt engine time plus full decode calls of min(C, slots) rows, at the curve's cost. The peer stacks
(bench/peers) run the same prompts through the same closed loop: OpenVINO GenAI's continuous batching, ONNX Runtime
GenAI's and transformers' static batches (at C, the requests waiting start together and run to their end); the
report's tables are bench/load_render.py's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specbuild.bench import decoding, peers
from specbuild.bench.engines import engine_precision, is_plain, load_engines, own_none
from specbuild.bench.results import Finished
from specbuild.errors import SpecbuildError
from specbuild.runtime.scheduler import Request, Scheduler

CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)
WARMUP_TOKENS = 4


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
        """Measure the call costs the run's steps can need before it is timed (the speculation policy's), and start
        the drafter's traffic from nothing: the warm-up and the earlier rounds and concurrencies sent these prompts."""
        self.scheduler.engine.forget_traffic()
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


# ---------------------------------------------------------------- the run
def measure(target, prompts: list[list[int]], concurrency: int, max_new_tokens: int, sampling=None):
    """A short warm-up loop (every batch size up to C seen once), then the measured closed loop: its row and outputs."""
    target.max_new_tokens = WARMUP_TOKENS
    closed_loop(target, [prompts[i % len(prompts)] for i in range(concurrency)], concurrency, sampling)
    target.max_new_tokens = max_new_tokens
    if hasattr(target, "prepare"):
        target.prepare()  # and what a drafter learnt from earlier runs of these prompts is forgotten
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
    plain = [is_plain(e) for e in engines]
    reference = dict(zip(labels, own_none(engines, labels)))
    baseline = next((lab for lab, p in zip(labels, plain) if p), None)
    lowest = min(int(c) for c in results)
    for c, res in results.items():
        first_peer = next(iter(res["peers"].values()), None)
        rows = [(label, row, "engines", reference[label]) for label, row in res["engines"].items()]
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
        for label, engine, plain_engine in zip(labels, engines, plain):
            if plain_engine:
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
    from specbuild.prompts import load_prompt_set, prompt_ids

    per_set = [[prompt_ids(engine.codec, name, t) for t in load_prompt_set(name, num_prompts)] for name in prompt_sets]
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
    repeats: int = 1,
    peer_args: dict | None = None,
    sampling=None,
    stock_kernels: bool = False,
) -> dict[str, Any]:
    """`specbuild bench --concurrency`: the report (settings, engines with their cost curves, rows per C). peer_args:
    the peer stacks' options by keyword (bench/peers); sampling: the run's SamplingParams (None: greedy; request i
    seeded with its seed + i)."""
    from specbuild.runtime.row_invariance import cpu_description

    peer_args = peer_args or {}
    peers.check(peer_args, under_load=True)
    engines, labels = load_engines(engine_dirs, max_new_tokens, threads, allow_lossy, stock_kernels)
    prompts = interleaved_prompts(engines[0], prompt_sets, num_prompts)
    targets = peers.load_peers(peer_args, threads, max(concurrency), max_new_tokens)
    log("measuring each engine's call cost")
    curves = [cost_curve_report(e) for e in engines]
    results = run_load(engines, labels, prompts, concurrency, max_new_tokens, targets, log, repeats, sampling)
    return {
        "settings": {
            "prompt_sets": prompt_sets,
            "num_prompts": num_prompts,
            "requests": len(prompts),
            "max_new_tokens": max_new_tokens,
            "concurrency": concurrency,
            "threads": threads,
            "repeats": repeats,
            **peers.settings(peer_args),
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
        "baseline": next((lab for lab, e in zip(labels, engines) if is_plain(e)), None),
        "load": results,
    }
