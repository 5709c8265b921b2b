"""Backend interface: run(feeds) -> outputs by name; last_engine_s = seconds spent inside the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specbuild.errors import SpecbuildError


class Backend:
    name = "base"
    last_engine_s: float = 0.0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError


def create_backend(engine_dir: Path, manifest: dict, backend: str | None = None, threads: int | None = None) -> Backend:
    if backend is None:
        backend = "tensorrt" if manifest["files"].get("plan") else "onnxruntime"
    if backend == "onnxruntime":
        from specbuild.runtime.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend(engine_dir, manifest, threads=threads)
    if backend == "tensorrt":
        from specbuild.runtime.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(engine_dir, manifest)
    raise SpecbuildError(f"unknown backend {backend!r}; choose onnxruntime or tensorrt")
