"""`specbuild bench`: generation (greedy, or sampled: bench/decoding.py) over prompt sets on several engines, and
optionally on other stacks, measured in one run with every engine and peer interleaved per prompt so that they share
the machine's noise.

Per prompt set and engine: tokens/s (overall and decode), TTFT, τ (mean tokens per decode step, bonus included),
speed-up against the first plain-decoding (`none`) engine, η = speed-up / τ, `vs_fastest` (tokens/s relative to
the fastest other row of the run), host overhead per decode step (ms and as a share of engine time), and whether
the output equals, token for token, that of the first `none` engine and of the `none` engine of the same weights
and activations. Peers (bench/peers: transformers, ONNX Runtime GenAI, OpenVINO GenAI, llama.cpp) are timed on the
same token ids. The report records the CPU, and each engine's exactness verdict on it. `--context-sweep` times host
and engine ms/step of the first engine at ~64 vs ~1024 tokens of context.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specbuild.bench import decoding, peers
from specbuild.bench.engines import is_plain, load_engines, own_none
from specbuild.bench.results import Sample
from specbuild.errors import SpecbuildError
from specbuild.prompts import TRAFFIC_SETS, load_prompt_set, prompt_ids

SWEEP_CONTEXTS = (64, 1024)
SWEEP_MIN_SEQ_LEN = 1100
SWEEP_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens and verifies them "
    "in one call of the target model, so every accepted draft saves a full forward pass. "
)
WARMUP_PROMPT = "Hello, world"


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
    threads: int | None = None,
    sweep: bool = False,
    log: Callable[[str], None] = print,
    allow_lossy: bool = False,
    peer_args: dict | None = None,
    sampling=None,
    stock_kernels: bool = False,
    passes: int = 1,
) -> dict[str, Any]:
    """The report of one run. peer_args: the peer stacks' options by keyword (bench/peers: e.g. {"ort_genai_dirs":
    [...]}); sampling: the run's SamplingParams (None: greedy), prompt i seeded with its seed + i
    (bench/decoding.py); passes: each prompt set runs that many times in order through the same loaded engines (the
    traffic a server sees again: modes that learn from earlier responses draft from the earlier passes), each pass
    reported apart (results "NAME", "NAME, pass 2", ...). Each set starts from nothing learnt (Engine.forget_traffic):
    one set's responses never draft another's."""
    from specbuild.runtime.row_invariance import cpu_description

    peer_args = peer_args or {}
    peers.check(peer_args, under_load=False)
    engines, labels = load_engines(engine_dirs, max_new_tokens, threads, allow_lossy, stock_kernels)
    prompts = {name: load_prompt_set(name, num_prompts) for name in prompt_sets}
    timers = peers.sequential_peers(peer_args, threads, engines[0].eos_ids)
    log("warming up")
    warm = engines[0].codec.encode(WARMUP_PROMPT)
    for eng in engines:
        timed_generate(eng, warm, 4)
    for timer in timers:
        timer.sample(warm, 4)
    baseline = next((lab for lab, e in zip(labels, engines) if is_plain(e)), None)
    report: dict[str, Any] = {
        "settings": {
            "prompt_sets": prompt_sets,
            "num_prompts": num_prompts,
            "max_new_tokens": max_new_tokens,
            "threads": threads,
            "passes": passes,
            **peers.settings(peer_args),
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
        "baseline": baseline,
        "results": {},
    }
    rows = dict(zip(labels, engines))
    for name, texts in prompts.items():
        for eng in engines:  # each set is traffic of its own: drafters that learn from responses start from nothing
            eng.forget_traffic()
        for n in range(1, passes + 1):
            key = name if n == 1 else f"{name}, pass {n}"
            samples, peer_samples = _run_set(name, texts, rows, timers, max_new_tokens, sampling, log)
            for part, cut in _parts(name, len(texts)):
                cut_samples = {label: s[cut] for label, s in samples.items()}
                cut_peers = [s[cut] for s in peer_samples]
                report["results"][key + part] = _rows(rows, cut_samples, cut_peers, timers, baseline)
    if sweep:
        report["context_sweep"] = {"engine": labels[0], **context_sweep(engines[0], max_new_tokens, log)}
    return report


def _parts(name: str, count: int) -> list[tuple[str, slice]]:
    """How a set's requests are reported: all of them; a traffic set (prompts.TRAFFIC_SETS) also by halves, the
    first requests apart from the later ones (what the drafters that learn from responses learnt)."""
    parts = [("", slice(None))]
    if name in TRAFFIC_SETS and count >= 2:
        half = count // 2
        parts += [(f" (requests 1-{half})", slice(None, half)), (f" (requests {half + 1}-{count})", slice(half, None))]
    return parts


def _run_set(name, texts, engines: dict, timers: list, max_new_tokens, sampling, log):
    """One prompt set: every prompt through each engine (labels -> engines) and each peer in turn, in order. Returns
    the samples by engine label and by peer."""
    codec = next(iter(engines.values())).codec
    samples: dict[str, list[Sample]] = {label: [] for label in engines}
    peer_samples: list[list[Sample]] = [[] for _ in timers]
    for i, text in enumerate(texts):
        ids = prompt_ids(codec, name, text)
        log(f"{name} {i + 1}/{len(texts)} ({len(ids)} prompt tokens)")
        request = decoding.for_request(sampling, i)
        for label, eng in engines.items():
            samples[label].append(timed_generate(eng, ids, max_new_tokens, sampling=request))
        for k, timer in enumerate(timers):
            peer_samples[k].append(timer.sample(ids, max_new_tokens, request))
    return samples, peer_samples


def _rows(engines: dict, samples: dict[str, list[Sample]], peer_samples: list[list[Sample]], timers, baseline) -> dict:
    """The report rows of some requests: per engine (labels -> engines, their samples), then per peer."""
    base = samples[baseline] if baseline is not None else None
    rows = {label: summarize(s, base) for label, s in samples.items()}
    # lossless is relative to the none engine of the same precision (int8 activations or cache change the output)
    for label, own in zip(engines, own_none(list(engines.values()), list(engines))):
        if own is not None and own != baseline:
            rows[label]["own_none"] = own
            rows[label]["matches_own_none"] = sum(
                a.output_ids == b.output_ids for a, b in zip(samples[label], samples[own])
            )
    base_tps = rows[baseline]["tokens_per_s"] if baseline is not None else None
    peer_rows = {}
    for timer, runs in zip(timers, peer_samples):
        row = summarize(runs, base)
        for key in ("host_ms_per_step", "host_share", "engine_ms_per_step"):
            row.pop(key)
        if not timer.ngram or not row["steps"]:  # transformers does not say how many steps it took
            row.pop("tau")
        row.pop("steps")
        row["speedup"] = row["tokens_per_s"] / base_tps if base_tps else None
        peer_rows[timer.label] = row
    add_relative_speed(rows, baseline, peer_rows)
    return {"engines": rows, "peers": peer_rows}


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
        counts = [r["prompts"] for r in res["engines"].values() if "prompts" in r]
        count = counts[0] if counts else settings["num_prompts"]
        table = Table(
            title=f"{name}: {count} prompts, {decoding.describe(settings.get('sampling'))}, max "
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
