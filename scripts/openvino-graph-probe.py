"""Can OpenVINO run an engine's own graphs faster than ONNX Runtime? (issue 50's "a backend that can", measured)

    python scripts/openvino-graph-probe.py ENGINE_DIR [--threads 2] [--rows 1,2,4,16]

For each way of running the engine -- ONNX Runtime on its fused graph and on the portable one, OpenVINO (CPU) on the
portable one in f32 and at its default precision (bf16 on AVX-512 BF16 / AMX CPUs), OpenVINO on the fused one -- it
prints the ms of one call of B rows at 256 cached tokens (Engine._timed_call, the cost curve's measurement; median of
7) and whether greedy generation of three prompts (32 tokens) gives ONNX Runtime's fused-graph tokens. OpenVINO runs
through a Backend of this script's (the runtime has none): a call's inputs by name, the KV outputs copied back into
the cache buffers the runtime keeps after the timed inference (ONNX Runtime binds them in place; OpenVINO's inference
writes them as new outputs, which its times include).
A way that cannot load the graph prints OpenVINO's reason.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbuild.runtime.backends import factory  # noqa: E402
from specbuild.runtime.backends.base import Backend  # noqa: E402

PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "import numpy as np\n"]


def openvino_backend(config: dict) -> type[Backend]:
    class OpenVinoBackend(Backend):
        name = "openvino"

        def __init__(self, engine_dir, manifest, graph, threads=0, shared_cores=False):
            import openvino as ov

            super().__init__(engine_dir, manifest, graph, threads, shared_cores)
            settings = {**config, **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
            self.compiled = ov.Core().compile_model(str(self.engine_dir / graph["file"]), "CPU", settings)
            self.request = self.compiled.create_infer_request()
            self.inputs = {port.get_any_name() for port in self.compiled.inputs}

        def run(self, feeds, aliases=None, buffers=None):
            inputs = {k: v for k, v in {**(buffers or {}), **feeds}.items() if k in self.inputs}
            start = time.perf_counter()
            result = self.request.infer(inputs)
            self.last_engine_s = time.perf_counter() - start
            outputs = {port.get_any_name(): value for port, value in result.items()}
            for output, source in (aliases or {}).items():  # the runtime reads its cache buffers: updated in place
                if output in outputs and source in inputs:
                    np.copyto(inputs[source], outputs[output])
                    outputs[output] = inputs[source]
            return outputs

    return OpenVinoBackend


def load(engine_dir, threads: int, graph: str | None, openvino: dict | None):
    from specbuild.runtime.engine import Engine

    chosen = factory.backend_class
    if openvino is not None:
        factory.backend_class = lambda _: openvino_backend(openvino)
    try:
        return Engine(engine_dir, graph=graph, threads=threads, allow_lossy=True)
    finally:
        factory.backend_class = chosen


def unreadable(engine_dir: Path, graph: str | None) -> str | None:
    """Why OpenVINO cannot read the graph the engine would run (its converter's failed operators), or None."""
    import openvino as ov

    from specbuild.runtime.manifest import load_manifest

    manifest = load_manifest(engine_dir)
    entry = factory.select_graph(manifest, graph or factory.default_backend(manifest), engine_dir)
    try:
        ov.Core().read_model(str(engine_dir / entry["file"]))
    except Exception as exc:  # noqa: BLE001 -- OpenVINO's converter raises a RuntimeError with a report
        lines = [line.strip() for line in str(exc).splitlines()]
        return " ".join(line for line in lines if line.startswith("--") or "expected" in line) or lines[0]
    return None


def call_ms(engine, rows: list[int], repeats: int = 7) -> dict[int, float]:
    engine.cost_curve()  # sets up the cost calls' state
    out = {}
    for batch in rows:
        engine._timed_call(batch, 1, False)
        times = sorted(engine._timed_call(batch, 1, False) for _ in range(repeats))
        out[batch] = round(1000 * times[repeats // 2], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,16")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    ways = [
        ("ONNX Runtime, fused graph", None, None),
        ("ONNX Runtime, portable graph", "tensorrt", None),
        ("OpenVINO f32, portable graph", "tensorrt", {"INFERENCE_PRECISION_HINT": "f32"}),
        ("OpenVINO default precision, portable graph", "tensorrt", {}),
        ("OpenVINO f32, fused graph", None, {"INFERENCE_PRECISION_HINT": "f32"}),
    ]
    reference = None
    for label, graph, openvino in ways:
        reason = unreadable(args.engine_dir, graph) if openvino is not None else None
        if reason:
            print(f"{label}: OpenVINO cannot read the graph ({reason})", flush=True)
            continue
        try:
            engine = load(args.engine_dir, args.threads, graph, openvino)
        except Exception as exc:  # noqa: BLE001 -- a probe: report why a way cannot run, go on
            print(f"{label}: cannot load ({str(exc).splitlines()[0][:300]})", flush=True)
            continue
        costs = call_ms(engine, rows)
        tokens = [engine.generate(p, max_new_tokens=32).output_ids for p in PROMPTS]
        reference = reference if reference is not None else tokens
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"{label}: ms per call by rows {costs}; greedy tokens as the first way's: {same}/{len(PROMPTS)}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
