"""One row per (engine, concurrency) from AIPerf's profile_export_aiperf.json and the server's spec-decode counters,
and the summary they make: JSON (the rows and the settings) and a markdown table."""

from __future__ import annotations

from typing import Any

# our name -> AIPerf's metric tag; latency percentiles in milliseconds
LATENCIES = {"ttft_ms": "time_to_first_token", "itl_ms": "inter_token_latency", "latency_ms": "request_latency"}
STATS = ("avg", "p50", "p90", "p99")
TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}
# the server's speculative-decoding counters (/metrics), read before and after each run
SPEC_COUNTERS = {
    "drafts": "specbuild:spec_decode_num_drafts_total",
    "draft_tokens": "specbuild:spec_decode_num_draft_tokens_total",
    "accepted": "specbuild:spec_decode_num_accepted_tokens_total",
}


def _avg(export: dict, tag: str, default: float | None = None) -> float | None:
    result = export.get(tag)
    return result.get("avg", default) if isinstance(result, dict) else default


def _latency_ms(export: dict, tag: str) -> dict[str, float | None]:
    result = export.get(tag) or {}
    scale = TO_MS.get(result.get("unit", "ms"), 1.0)
    return {s: (result[s] * scale if result.get(s) is not None else None) for s in STATS}


def spec_decode_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """What the run added to the server's spec-decode counters (its warm-up requests included)."""
    return {key: int(after.get(name, 0.0) - before.get(name, 0.0)) for key, name in SPEC_COUNTERS.items()}


def acceptance_length(counts: dict[str, int]) -> float | None:
    """Mean acceptance length (vLLM's: 1 + accepted draft tokens / drafting steps); None if no step drafted (a
    `none` engine, or speculation switched off by the cost policy)."""
    return 1.0 + counts["accepted"] / counts["drafts"] if counts["drafts"] else None


def summary_row(engine: str, mode: str, concurrency: int, export: dict, spec: dict[str, int]) -> dict[str, Any]:
    row = {
        "engine": engine,
        "mode": mode,
        "concurrency": concurrency,
        "requests": int(_avg(export, "request_count", 0) or 0),
        "errors": int(_avg(export, "error_request_count", 0) or 0),
        "output_tokens_per_s": _avg(export, "output_token_throughput"),
        "output_tokens_per_s_per_user": _avg(export, "output_token_throughput_per_user"),
        "requests_per_s": _avg(export, "request_throughput"),
        "input_tokens_mean": _avg(export, "input_sequence_length"),
        "output_tokens_mean": _avg(export, "output_sequence_length"),
        "acceptance_length": acceptance_length(spec),
        "spec_decode": spec,
    }
    row.update({name: _latency_ms(export, tag) for name, tag in LATENCIES.items()})
    return row


def speedups(rows: list[dict], baseline: str) -> None:
    """Each row's output tokens/s over the baseline engine's at the same concurrency (in place, key `vs_baseline`)."""
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["engine"] == baseline}
    for row in rows:
        reference = base.get(row["concurrency"])
        ok = reference and row["output_tokens_per_s"] is not None
        row["vs_baseline"] = row["output_tokens_per_s"] / reference if ok else None


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percentiles(stats: dict) -> str:
    return " / ".join(_num(stats[s], 0 if (stats[s] or 0) >= 100 else 1) for s in ("p50", "p90", "p99"))


def _acceptance(row: dict) -> str:
    drafts = row["spec_decode"]["drafts"]
    return f"{_num(row['acceptance_length'], 2)} ({drafts})" if drafts else "-"


def markdown_table(rows: list[dict], baseline: str | None) -> str:
    header = [
        "engine", "mode", "C", "requests (errors)", "output tok/s", f"vs {baseline or '-'}", "tok/s per user",
        "TTFT ms p50/p90/p99", "ITL ms p50/p90/p99", "latency ms p50/p90/p99", "ISL", "OSL", "accept len (drafts)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in sorted(rows, key=lambda r: r["concurrency"]):  # engines in their given order
        cells = [
            r["engine"], r["mode"], str(r["concurrency"]), f"{r['requests']} ({r['errors']})",
            _num(r["output_tokens_per_s"]), _num(r.get("vs_baseline"), 2) + ("x" if r.get("vs_baseline") else ""),
            _num(r["output_tokens_per_s_per_user"]), _percentiles(r["ttft_ms"]), _percentiles(r["itl_ms"]),
            _percentiles(r["latency_ms"]), _num(r["input_tokens_mean"], 0), _num(r["output_tokens_mean"], 1),
            _acceptance(r),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
