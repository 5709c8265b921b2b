"""The tables of a load benchmark's report (bench/load.py): tokens/s, latencies, τ and exactness per engine and peer
at each concurrency, and each engine's measured call cost against rows per call."""

from __future__ import annotations

from typing import Any

from specbuild.bench import decoding
from specbuild.bench.load import CURVE_ROWS


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
