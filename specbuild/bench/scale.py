"""What a model's size costs: convert and build time and peak memory, tokens/s and the call cost curve, beside ONNX
Runtime GenAI on the same checkpoint (a benchmark script, not a test).

    python -m specbuild.bench.scale --shape llama-3.2-1b --work-dir /tmp/scale
    python -m specbuild.bench.scale --model-dir SMOLLM2_HF_DIR --work-dir /tmp/scale-135m

For each precision (fp32, int8, int4, int4a = int4 with int8 activations) it converts once, builds the `none` engine
(the onnxruntime graph, what a CPU user runs), and runs ONNX Runtime GenAI's model builder on the same HF checkpoint at
the precisions it has (fp32, int4); each command runs in its own process, timed, its peak RSS the larger of the
kernel's (wait4: one process's) and its process tree's summed RSS sampled every 0.1 s. A build the machine cannot
hold is refused by the build itself (builder/memory_budget.py) and reported so.
Then one interleaved run per precision (`specbuild bench`'s loop: each prompt through every engine and peer in turn)
gives tokens/s of `none` beside GenAI's, and the engine's cost curve (ms of one call against rows 1-64) says how much
speculation can gain at this size. Writes a markdown table and the numbers as JSON into the work directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specbuild.modes.registry import baseline_mode

PRECISIONS = {"fp32": [], "int8": ["--weights", "int8"], "int4": ["--weights", "int4"],
              "int4a": ["--weights", "int4", "--int8-activations"]}  # fmt: skip
GENAI_PRECISIONS = {"fp32": "fp32", "int4": "int4", "int4a": "int4"}  # GenAI's int4 computes with int8 activations
CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)


class TreeMemory:
    """The peak of the summed RSS of a process and its descendants, sampled every 0.1 s on a thread."""

    def __init__(self, pid: int):
        import threading

        self.peak, self._pid, self._done = 0, pid, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        while not self._done.wait(0.1):
            try:
                root = psutil.Process(self._pid)
                processes = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for process in processes:
                try:
                    total += process.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def measured(cmd: list[str], log) -> dict:
    """Run `cmd` in its own process: wall seconds, peak RSS (GB) and exit status; its last output line."""
    log("$ " + " ".join(cmd))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tree = TreeMemory(proc.pid)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
    _, status, usage = os.wait4(proc.pid, 0)
    tree.stop()
    proc.returncode = os.waitstatus_to_exitcode(status)
    result = {
        "seconds": round(time.perf_counter() - start, 1),
        # the kernel's peak is one process's (ru_maxrss, KiB): a build that checks in a child process is two
        "peak_rss_gb": round(max(usage.ru_maxrss * 1024, tree.peak) / 1e9, 2),
        "rc": proc.returncode,
        "last_line": lines[-1] if lines else "",
    }
    log(f"  {result['seconds']} s, peak RSS {result['peak_rss_gb']} GB, exit {result['rc']}: {result['last_line']}")
    return result


def specbuild_cli() -> list[str]:
    return [sys.executable, "-c", "from specbuild.cli.main import cli; cli()"]


def dir_gb(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9, 2) if path.exists() else 0.0


def cost_curve(engine_dir: Path, threads: int | None) -> list[dict]:
    """ms of one call of the engine's `none` graph against rows per call (its cost curve, measured here)."""
    from specbuild.bench.load import cost_curve_report
    from specbuild.runtime.engine import Engine

    engine = Engine(engine_dir, threads=threads)
    return [row for row in cost_curve_report(engine)["rows_curve"] if row["rows"] in CURVE_ROWS]


def run(args, log=print) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    hf = Path(args.model_dir) if args.model_dir else work / f"{args.shape}-hf"
    if not hf.exists():
        from specbuild.bench.checkpoints import write_checkpoint

        write_checkpoint(args.shape, hf, seed=0)
    report: dict = {"model": str(hf), "cpu": _cpu(), "convert": {}, "builds": {}, "genai_builds": {}, "speed": {}}
    ckpt = work / "ckpt"
    report["convert"] = measured([*specbuild_cli(), "convert", "--model-dir", str(hf), "--output-dir", str(ckpt),
                                  "--overwrite"], log)  # fmt: skip
    engines, genai = {}, {}
    for precision in args.precisions:
        out = work / f"engine-{precision}"
        cmd = [*specbuild_cli(), "build", "--checkpoint-dir", str(ckpt), "--speculative-mode", baseline_mode(),
               "--backends", "onnxruntime", "--output-dir", str(out), "--overwrite",
               *PRECISIONS[precision]]  # fmt: skip
        report["builds"][precision] = {**measured(cmd, log), "engine_gb": dir_gb(out)}
        if report["builds"][precision]["rc"] == 0:
            engines[precision] = out
        kind = GENAI_PRECISIONS.get(precision)
        if args.genai and kind and kind not in report["genai_builds"]:
            gout = work / f"genai-{kind}"
            cmd = [sys.executable, "-m", "specbuild.bench.genai_builder", "-i", str(hf), "-o", str(gout), "-p",
                   kind, "-e", "cpu", "-c", str(work / "genai-cache")]  # fmt: skip
            report["genai_builds"][kind] = {**measured(cmd, log), "engine_gb": dir_gb(gout)}
            if report["genai_builds"][kind]["rc"] == 0:
                genai[kind] = gout
    if args.speed:
        from specbuild.bench.sequential import run_benchmark

        for precision, engine in engines.items():
            peer = genai.get(GENAI_PRECISIONS.get(precision, ""))
            result = run_benchmark([engine], args.prompts.split(","), args.num_prompts, args.max_new_tokens,
                                   threads=args.threads, log=log,
                                   peer_args={"ort_genai_dirs": [peer] if peer else []})  # fmt: skip
            report["speed"][precision] = {
                "sets": {
                    name: {
                        baseline_mode(): next(iter(r["engines"].values()))["tokens_per_s"],
                        **{label: row["tokens_per_s"] for label, row in r["peers"].items()},
                    }
                    for name, r in result["results"].items()
                },  # fmt: skip
                "cost_curve": cost_curve(engine, args.threads),
            }
    (work / "scale.json").write_text(json.dumps(report, indent=1))
    table = render(report)
    (work / "scale.md").write_text(table)
    log(table)
    return report


def render(report: dict) -> str:
    """The markdown table of a report: one row per step, then tokens/s and the cost curve per precision."""
    lines = [f"model `{report['model']}` on {report['cpu']}", "",
             "| step | specbuild s | specbuild peak GB | GenAI builder s | GenAI peak GB | output GB |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    conv = report["convert"]
    lines.append(f"| convert | {conv['seconds']} | {conv['peak_rss_gb']} | | | |")
    for precision, build in report["builds"].items():
        genai = report["genai_builds"].get(GENAI_PRECISIONS.get(precision, ""), {})
        ours = f"{build['seconds']}" if build["rc"] == 0 else f"refused ({build['last_line'][:60]})"
        theirs = f"{genai['seconds']}" if genai.get("rc") == 0 else ("failed" if genai else "")
        sizes = f"{build['engine_gb']} / {genai.get('engine_gb', '')}"
        lines.append(f"| build {precision} | {ours} | {build['peak_rss_gb']} | {theirs} | "
                     f"{genai.get('peak_rss_gb', '')} | {sizes} |")  # fmt: skip
    for precision, speed in report["speed"].items():
        lines += ["", f"**{precision}** tokens/s (greedy, interleaved per prompt):", ""]
        for name, row in speed["sets"].items():
            lines.append(f"- {name}: " + ", ".join(f"{label} {tps:.2f}" for label, tps in row.items()))
        curve = ", ".join(f"{r['rows']}: {r['ms']:.1f}" for r in speed["cost_curve"])
        lines.append(f"- cost curve, ms per call by rows: {curve}")
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    from specbuild.runtime.row_invariance import cpu_description

    return cpu_description()


def main(argv=None) -> None:
    from specbuild.bench.checkpoints import SHAPES

    parser = argparse.ArgumentParser(prog="python -m specbuild.bench.scale", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shape", choices=sorted(SHAPES), help="A random checkpoint at this shape (written once).")
    source.add_argument("--model-dir", help="An existing HF checkpoint directory (e.g. SmolLM2's).")
    parser.add_argument("--work-dir", required=True, help="Where the checkpoint, engines and report go.")
    parser.add_argument("--precisions", default="fp32,int8,int4,int4a", type=lambda s: s.split(","))
    parser.add_argument("--no-genai", dest="genai", action="store_false", help="Skip ONNX Runtime GenAI.")
    parser.add_argument("--no-speed", dest="speed", action="store_false", help="Build costs only.")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"--precisions: {unknown[0]} is not one of {', '.join(PRECISIONS)}")
    run(args)


if __name__ == "__main__":
    main()
