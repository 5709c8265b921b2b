"""The summary's picture: output tokens/s, TTFT, ITL and request latency against concurrency, one line per engine
(p50 solid, p90 dashed), as a PNG. Needs matplotlib (`pip install specbuild[bench]`)."""

from __future__ import annotations

from pathlib import Path

PANELS = (("ttft_ms", "TTFT (ms)"), ("itl_ms", "inter-token latency (ms)"), ("latency_ms", "request latency (ms)"))


def write_plot(rows: list[dict], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for i, engine in enumerate(engines):
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        color = f"C{i}"
        axes[0][0].plot(xs, [r["output_tokens_per_s"] for r in mine], "o-", color=color, label=engine)
        for ax, (key, _) in zip(axes.flat[1:], PANELS):
            ax.plot(xs, [r[key]["p50"] for r in mine], "o-", color=color, label=f"{engine} p50")
            ax.plot(xs, [r[key]["p90"] for r in mine], "x--", color=color, alpha=0.6, label=f"{engine} p90")
    axes[0][0].set_ylabel("output tokens/s (all requests)")
    for ax, (_, label) in zip(axes.flat[1:], PANELS):
        ax.set_ylabel(label)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
