"""ONNX Runtime's profiler on one decode call of B sequences (1, 2, 4, 16) at 256 cached tokens: a specbuild engine's
call (Engine._timed_call) or ONNX Runtime GenAI's generator step; ms per call by operator type (kernel time).
Profiles go to $PROFILE_DIR (default /tmp/step-profiles); the table to profile-{ours,genai}-NAME.json there.

    python scripts/profile-step-ops.py ours ENGINE_DIR
    python scripts/profile-step-ops.py genai GENAI_MODEL_DIR
"""

import glob
import importlib.util
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

ROWS = [1, 2, 4, 16]
REPS = 20
CONTEXT = 256
# the timed calls are those of step-cost-vs-genai.py, loaded from beside this script
_spec = importlib.util.spec_from_file_location("step_cost", Path(__file__).with_name("step-cost-vs-genai.py"))
step_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_cost)
OUT = Path(os.environ.get("PROFILE_DIR", "/tmp/step-profiles"))
OUT.mkdir(parents=True, exist_ok=True)


def summarize(path, skip_prefill=False):
    """ms per call by operator type (kernel time) of a profile; skip_prefill: the first run is a prefill, left out."""
    events = json.load(open(path))
    runs = [e for e in events if e.get("name") == "model_run"]
    start = runs[1]["ts"] if skip_prefill else 0
    runs = runs[1:] if skip_prefill else runs
    by = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            by[e["args"]["op_name"]] += e["dur"] / 1000
    n = len(runs)
    return {k: v / n for k, v in sorted(by.items(), key=lambda kv: -kv[1])} | {"_runs": n}


def ours(engine_dir):
    from specbuild.runtime.backends import onnxruntime as be

    base = be.session_options
    state = {}

    def opts(*a, **k):
        o = base(*a, **k)
        o.enable_profiling = True
        o.profile_file_prefix = f"{OUT}/prof-ours-{state['rows']}"
        return o

    from specbuild.runtime.engine import Engine

    out = {}
    for rows in ROWS:
        state["rows"] = rows
        be.session_options = opts
        eng = Engine(engine_dir)
        eng.cost_curve()
        be.session_options = base
        wall = step_cost.ours(eng, rows, REPS)
        sess = eng.backend.session if hasattr(eng.backend, "session") else eng.backend.sess
        path = sess.end_profiling()
        prof = summarize(path)
        out[rows] = {"wall_ms": wall, "ops": prof}
        del eng
    return out


def genai(model_dir):
    import shutil

    import onnxruntime_genai as og

    out = {}
    for rows in ROWS:
        prof_dir = f"{OUT}/gprof-{rows}"
        shutil.rmtree(prof_dir, ignore_errors=True)
        shutil.copytree(model_dir, prof_dir)
        cfg = json.load(open(f"{prof_dir}/genai_config.json"))
        cfg["model"]["decoder"]["session_options"]["enable_profiling"] = f"{OUT}/prof-genai-{rows}"
        json.dump(cfg, open(f"{prof_dir}/genai_config.json", "w"))
        model = og.Model(prof_dir)
        wall = step_cost.genai(model, rows, CONTEXT, REPS)
        del model
        path = sorted(glob.glob(f"{OUT}/prof-genai-{rows}*.json"))[-1]
        out[rows] = {"wall_ms": wall, "ops": summarize(path, skip_prefill=True)}
    return out


if __name__ == "__main__":
    which, path = sys.argv[1], sys.argv[2]
    res = ours(path) if which == "ours" else genai(path)
    json.dump(res, open(OUT / f"profile-{which}-{os.path.basename(path)}.json", "w"), indent=1)
    for rows, r in res.items():
        ops = {k: v for k, v in r["ops"].items() if not k.startswith("_")}
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(ops.items())[:8])
        print(
            f"{which} {os.path.basename(path)} rows {rows}: wall {r['wall_ms']:.2f} ms; "
            f"ops {sum(ops.values()):.2f}; {top}"
        )
