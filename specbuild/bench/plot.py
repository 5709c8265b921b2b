"""The benchmark's picture: tokens/s and τ of every row (our engines, then peers) for each prompt set, as a PNG.

Written beside the JSON report by `specbuild bench --json-out X.json` (as X.png) when matplotlib is installed
(`pip install specbuild[bench]`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINE_COLOR = "#1f77b4"
PEER_COLOR = "#9e9e9e"


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def rows_of(result: dict[str, Any]) -> list[tuple[str, dict, bool]]:
    """(label, row, is ours) for every row of one prompt set, engines first."""
    rows = [(label, row, True) for label, row in result["engines"].items()]
    rows += [(label, row, False) for label, row in (result.get("peers") or {}).items()]
    return rows


def write_plot(report: dict[str, Any], path: str | Path) -> Path:
    """One column per prompt set: tokens/s (bars, baseline dashed) above τ (bars; rows without τ are blank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(report["results"])
    n_rows = max(len(rows_of(report["results"][name])) for name in sets)
    fig, axes = plt.subplots(2, len(sets), figsize=(4 + 0.45 * n_rows * len(sets), 7.5), squeeze=False)
    baseline = report.get("baseline")
    settings = report["settings"]
    for col, name in enumerate(sets):
        rows = rows_of(report["results"][name])
        labels = [label for label, _, _ in rows]
        colors = [ENGINE_COLOR if ours else PEER_COLOR for _, _, ours in rows]
        speed, tau = axes[0][col], axes[1][col]
        values = [row["tokens_per_s"] for _, row, _ in rows]
        speed.bar(range(len(rows)), values, color=colors)
        for x, v in enumerate(values):
            speed.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
        if baseline in report["results"][name]["engines"]:
            speed.axhline(report["results"][name]["engines"][baseline]["tokens_per_s"], color="k", ls="--", lw=0.8)
        speed.set_title(f"{name}: tokens/s ({settings['num_prompts']} prompts, {settings['max_new_tokens']} new)")
        taus = [row.get("tau") or 0.0 for _, row, _ in rows]
        tau.bar(range(len(rows)), taus, color=colors)
        tau.axhline(1.0, color="k", ls="--", lw=0.8)
        tau.set_title(f"{name}: τ (tokens per step)")
        for ax in (speed, tau):
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.suptitle("specbuild bench (blue: engines, grey: other runtimes; dashed: baseline / τ = 1)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
