"""TensorRT execution backend: runs an engine directory's ``model.plan`` through polygraphy's TrtRunner.

Imports neither torch, tensorrt nor polygraphy at module level (import-safe without them); constructing
:class:`TensorRTBackend` on a host without TensorRT raises a one-line SpecbuildError. Feeds and results are host
numpy arrays.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from pathlib import Path

import numpy as np

from specbuild.engine_format import ENGINE_PLAN
from specbuild.errors import SpecbuildError
from specbuild.runtime.backends.base import Backend

TENSORRT_MISSING = (
    "the tensorrt backend needs the TensorRT Python package (pip install specbuild[trt]) on an NVIDIA GPU host"
)


def _plan_file(engine_dir: Path, manifest: dict) -> Path:
    files = manifest.get("files") or {}
    name = files.get("plan") or (ENGINE_PLAN if (engine_dir / ENGINE_PLAN).is_file() else None)
    if not name:
        raise SpecbuildError(
            f"engine {str(engine_dir)!r} has no TensorRT plan; rebuild it with --tensorrt or use onnxruntime"
        )
    path = engine_dir / name
    if not path.is_file():
        raise SpecbuildError(f"TensorRT plan {str(path)!r} is missing")
    return path


def tensorrt_available() -> bool:
    """True when the ``tensorrt`` Python package imports on this host."""
    if importlib.util.find_spec("tensorrt") is None:
        return False
    try:
        importlib.import_module("tensorrt")
    except Exception:  # noqa: BLE001 - a broken install (missing libnvinfer, no driver) counts as unavailable
        return False
    return True


class TensorRTBackend(Backend):
    """Runs one step of the engine on the GPU: ``run(feeds) -> outputs``; ``last_engine_s`` times the engine.
    The plan is compiled from the graph entry's portable graph; TensorRT picks its own threads."""

    name = "tensorrt"

    def __init__(self, engine_dir: Path, manifest: dict, graph: dict, threads: int = 0, shared_cores: bool = False):
        if not tensorrt_available():
            raise SpecbuildError(TENSORRT_MISSING)
        super().__init__(engine_dir, manifest, graph, threads, shared_cores)
        self.plan_path = _plan_file(self.engine_dir, manifest or {})

        from polygraphy.backend.common import BytesFromPath
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        try:
            self._runner = TrtRunner(EngineFromBytes(BytesFromPath(str(self.plan_path))), name="specbuild")
            self._runner.activate()
        except Exception as exc:  # noqa: BLE001 - deserialization failures (version mismatch, other GPU)
            raise SpecbuildError(f"cannot load TensorRT plan {str(self.plan_path)!r}: {exc}") from None

    def run(self, feeds: dict, aliases: dict[str, str] | None = None, buffers: dict | None = None) -> dict:
        """aliases is unused: the tensorrt graph is the portable one (stacked KV cache, no in-place buffers)."""
        if buffers:
            feeds = {**buffers, **feeds}
        started = time.perf_counter()
        outputs = self._runner.infer(feed_dict=feeds, copy_outputs_to_host=True)
        try:
            self.last_engine_s = float(self._runner.last_inference_time())
        except Exception:  # noqa: BLE001
            self.last_engine_s = time.perf_counter() - started
        # The runner reuses its host buffers between calls: hand back copies.
        return {name: np.array(value, copy=True) for name, value in outputs.items()}

    def close(self) -> None:
        runner = getattr(self, "_runner", None)
        if runner is not None and runner.is_active:
            runner.deactivate()
        self._runner = None
