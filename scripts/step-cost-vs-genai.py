"""One decode step of B sequences at C cached tokens, in one interleaved run: a specbuild engine's call (the call the
cost curve times, Engine._timed_call) against ONNX Runtime GenAI's generator step at static batch B (same ONNX
Runtime, same machine). Prints a line per point and writes step-cost.json.

    python scripts/step-cost-vs-genai.py int4:ENGINE_DIR:GENAI_DIR [fp32:ENGINE_DIR:GENAI_DIR ...]

GenAI's models come from its builder on the same HF checkpoint (docs/benchmarking.md)."""

import json
import sys
import time

import numpy as np
import onnxruntime_genai as og

from specbuild.runtime import speculation
from specbuild.runtime.engine import Engine


def ours(eng, rows, reps=20):
    for _ in range(3):
        eng._timed_call(rows, 1, False)
    t = time.perf_counter()
    for _ in range(reps):
        eng._timed_call(rows, 1, False)
    return (time.perf_counter() - t) / reps * 1000


def genai(model, rows, context, reps=20):
    p = og.GeneratorParams(model)
    p.set_search_options(max_length=context + reps + 8, do_sample=False, batch_size=rows)
    g = og.Generator(model, p)
    g.append_tokens(np.tile(np.arange(10, 10 + context, dtype=np.int32), (rows, 1)))
    for _ in range(3):
        g.generate_next_token()
    t = time.perf_counter()
    for _ in range(reps):
        g.generate_next_token()
    return (time.perf_counter() - t) / reps * 1000


if __name__ == "__main__":
    res = []
    for prec, e, gdir in (arg.split(":") for arg in sys.argv[1:]):
        eng = Engine(e)
        eng.cost_curve()
        model = og.Model(gdir)
        for context in (64, 256):
            speculation.COST_CONTEXT = context
            eng._cost_batches.clear()
            for rows in (1, 2, 4, 16):
                a = ours(eng, rows)
                b = genai(model, rows, context)
                res.append(dict(precision=prec, context=context, rows=rows, ours_ms=round(a, 2), genai_ms=round(b, 2)))
                print(
                    f"{prec} context {context} rows {rows}: ours {a:.2f} ms, GenAI {b:.2f} ms, ratio {a / b:.2f}",
                    flush=True,
                )
        del eng, model
    json.dump(res, open("step-cost.json", "w"), indent=1)
