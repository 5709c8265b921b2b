"""Engines side by side on this machine, interleaved (each round times every engine in turn, so a slow spell of the
machine falls on all of them): the ms of one call of B rows at 256 cached tokens (Engine._timed_call, the cost
curve's measurement, measured afresh: the user cache is not read) and the seconds to prefill the 16 load-benchmark
prompts one at a time (8 HumanEval + 8 MT-Bench, each a 1-token generation). Prints median and min per engine.

    python scripts/ab-engines.py ENGINE_DIR ENGINE_DIR [...] [--rows 1,4,16] [--rounds 7] [--stock-kernels]

--stock-kernels adds each engine that runs on specbuild's own kernels (int8 activations or an int8 KV cache) a
second time on ONNX Runtime's stock kernels ("ENGINE_DIR (stock)"), timed in the same rounds.

The before/after test of a graph change (docs/benchmarks/2026-12-04-run-AP-int8-quantize-linear.md): the load
benchmark's rounds vary by more than such a change between rounds on a shared 2-core machine. The calls are timed by
scripts/step-cost-vs-genai.py's function (so onnxruntime-genai, of specbuild[bench], must be installed).
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbuild.bench.load import interleaved_prompts  # noqa: E402
from specbuild.runtime import kernels  # noqa: E402
from specbuild.runtime.engine import Engine  # noqa: E402

_spec = importlib.util.spec_from_file_location("step_cost", Path(__file__).with_name("step-cost-vs-genai.py"))
step_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_cost)


def call_ms(engine, rows: int) -> float:
    return step_cost.ours(engine, rows, reps=10)  # the cost curve's call, timed as step-cost-vs-genai.py times it


def prefill_s(engine, prompts) -> float:
    start = time.perf_counter()
    for ids in prompts:
        engine.generate(input_ids=ids, max_new_tokens=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", nargs="+")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stock-kernels", action="store_true")
    args = parser.parse_args()
    engines = {}
    for name in args.engines:
        engines[name] = Engine(name)
        if args.stock_kernels and engines[name].kernels_tag != "stock":
            with kernels.stock():  # the session is made inside; the timed calls run on it later
                engines[f"{name} (stock)"] = Engine(name, allow_lossy=True)
    prompts = interleaved_prompts(next(iter(engines.values())), ["humaneval", "mtbench"], 8)
    for engine in engines.values():
        engine.cost_curve()  # sets up the timed calls' batches (the cached curve itself is not used)
        prefill_s(engine, prompts[:2])  # warm-up
    measures = [(f"call of {r} rows, ms", lambda e, r=int(r): call_ms(e, r)) for r in args.rows.split(",")]
    measures.append(
        (f"prefill of {len(prompts)} prompts ({sum(map(len, prompts))} tokens), s", lambda e: prefill_s(e, prompts))
    )
    for label, measure in measures:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(measure(engine))
        cells = ", ".join(f"{n} {statistics.median(t):.3f} (min {min(t):.3f})" for n, t in times.items())
        print(f"{label}: {cells}", flush=True)


if __name__ == "__main__":
    main()
