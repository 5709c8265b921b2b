"""`python -m specbuild.bench.serve --engine-dir A --engine-dir B [--concurrency 1,4,16] ...` (what
scripts/bench-serve.sh runs, with --aiperf from its AIPerf environment)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specbuild.bench.serve.run import Settings, run_benchmark
from specbuild.errors import SpecbuildError


def concurrency_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(prog="scripts/bench-serve.sh", description=__doc__)
    parser.add_argument(
        "--engine-dir", dest="engine_dirs", action="append", required=True, type=Path, help="repeat: each is served"
    )
    parser.add_argument("--concurrency", type=concurrency_list, default=[1, 4, 16], help="default 1,4,16")
    parser.add_argument("--requests", type=int, default=32, help="measured requests per concurrency (default 32)")
    parser.add_argument("--output-tokens", type=int, default=128, help="max tokens per request (default 128)")
    parser.add_argument(
        "--prompts",
        default="mtbench",
        help="prompt sets of specbuild.prompts (mtbench, humaneval, summarize; comma-separated are interleaved), "
        "or synthetic:N for AIPerf's random prompts of N tokens (default mtbench)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("bench-serve-out"), help="default bench-serve-out/")
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable (default: aiperf on PATH)")
    parser.add_argument("--threads", type=int, help="specbuild serve --threads (ONNX Runtime intra-op threads)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.output_tokens < 1:
        parser.error("--requests and --output-tokens must be >= 1")
    return Settings(**vars(args))


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    try:
        report = run_benchmark(settings, log=lambda line: print(line, flush=True))
    except SpecbuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print((settings.out_dir / "summary.md").read_text())
    print(f"in {settings.out_dir}: summary.md, summary.json, summary.png, commands.sh, one folder per engine")
    return 0 if all(row["errors"] == 0 for row in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
