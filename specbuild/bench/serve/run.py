"""The benchmark loop: each engine served in turn, AIPerf at each concurrency, the summary rewritten after every run
(so an interrupted benchmark keeps what it measured). Every command is printed and kept in commands.sh."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

from specbuild.bench.serve.aiperf_run import aiperf_command, run_aiperf, shell_line
from specbuild.bench.serve.dataset import dataset_args
from specbuild.bench.serve.server_process import ServedEngine
from specbuild.bench.serve.summary import markdown_table, spec_decode_counts, speedups, summary_row
from specbuild.errors import SpecbuildError
from specbuild.modes.registry import get_mode


@dataclasses.dataclass
class Settings:
    engine_dirs: list[Path]
    concurrency: list[int]
    requests: int
    output_tokens: int
    prompts: str
    out_dir: Path
    aiperf: str
    threads: int | None = None


def engine_labels(engine_dirs: list[Path]) -> list[str]:
    """The model name each engine is served and reported under: its directory's name (parent-name if two clash)."""
    names = [Path(d).resolve().name for d in engine_dirs]
    labels = [f"{Path(d).resolve().parent.name}-{n}" if names.count(n) > 1 else n for d, n in zip(engine_dirs, names)]
    if len(set(labels)) != len(labels):
        raise SpecbuildError(f"engine directories need distinct names, got {', '.join(labels)}")
    return labels


def engine_mode(engine_dir: Path) -> str:
    from specbuild.runtime.manifest import load_manifest

    return load_manifest(engine_dir, check_files=False)["speculative_mode"]


def run_benchmark(settings: Settings, log: Callable[[str], None] = print) -> dict:
    out = settings.out_dir
    out.mkdir(parents=True, exist_ok=True)
    inputs = dataset_args(settings.prompts, settings.requests, settings.output_tokens, out)
    labels = engine_labels(settings.engine_dirs)
    modes = [engine_mode(d) for d in settings.engine_dirs]
    baseline = next((label for label, mode in zip(labels, modes) if get_mode(mode).baseline), None)
    report = {"settings": _settings_json(settings, labels, modes, baseline), "commands": [], "rows": []}
    for engine_dir, label, mode in zip(settings.engine_dirs, labels, modes):
        (out / label).mkdir(exist_ok=True)
        serve_args = ("--threads", str(settings.threads)) if settings.threads else ()
        server = ServedEngine(engine_dir, label, out / label / "serve.log", serve_args)
        _record(report, shlex.join(server.command), log)
        with server:
            log(f"{label}: ready on {server.url}")
            for c in settings.concurrency:
                artifacts = out / label / f"c{c}"
                shutil.rmtree(artifacts, ignore_errors=True)  # a rerun's artifacts replace the last ones
                command = aiperf_command(
                    settings.aiperf, server.url, label, Path(engine_dir), c, settings.requests,
                    settings.output_tokens, inputs, artifacts,
                )  # fmt: skip
                _record(report, shell_line(command), log)
                before = server.metrics()
                export = run_aiperf(command, artifacts)
                row = summary_row(label, mode, c, export, spec_decode_counts(before, server.metrics()))
                report["settings"]["aiperf_version"] = export.get("aiperf_version")
                report["rows"].append(row)
                log(f"{label} C={c}: {row['output_tokens_per_s'] or 0:.1f} output tok/s, {row['errors']} errors")
                write_summary(report, out)
    return report


def _record(report: dict, line: str, log: Callable[[str], None]) -> None:
    report["commands"].append(line)
    log(f"$ {line}")


def _settings_json(settings: Settings, labels: list[str], modes: list[str], baseline: str | None) -> dict:
    return {
        "engines": {label: {"dir": str(d), "mode": m} for label, d, m in zip(labels, settings.engine_dirs, modes)},
        "baseline": baseline,
        "concurrency": settings.concurrency,
        "requests": settings.requests,
        "output_tokens": settings.output_tokens,
        "prompts": settings.prompts,
        "threads": settings.threads,
        "endpoint": "chat, streaming, temperature 0",
    }


def write_summary(report: dict, out: Path) -> None:
    """summary.json, summary.md, commands.sh and (with matplotlib) summary.png in `out`."""
    baseline = report["settings"]["baseline"]
    if baseline:
        speedups(report["rows"], baseline)
    (out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "summary.md").write_text(_title(report) + "\n\n" + markdown_table(report["rows"], baseline) + "\n")
    (out / "commands.sh").write_text("#!/usr/bin/env bash\n" + "\n".join(report["commands"]) + "\n")
    from specbuild.bench.plot import plot_available

    if plot_available():  # else only the tables (pip install specbuild[bench] for the plot)
        from specbuild.bench.serve.plot import write_plot

        write_plot(report["rows"], _title(report), out / "summary.png")


def _title(report: dict) -> str:
    s = report["settings"]
    return (
        f"specbuild serve under AIPerf {s.get('aiperf_version') or ''}: chat, streaming, greedy; {s['requests']} "
        f"requests of at most {s['output_tokens']} tokens per concurrency; prompts {s['prompts']}"
    )
