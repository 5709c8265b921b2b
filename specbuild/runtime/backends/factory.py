"""Which backend runs an engine, on which of its graphs.

An engine lists its graphs in engine.yaml (role, backend, file, KV layout); the onnxruntime backend runs the graph
built for it (its fused kernels), else the portable one; the tensorrt backend runs the plan compiled from the
portable graph. Backends are imported only when chosen.
"""

from __future__ import annotations

from pathlib import Path

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.backends.base import Backend


def default_backend(manifest: dict) -> str:
    return ef.BACKEND_TENSORRT if manifest["files"].get("plan") else ef.BACKEND_ONNXRUNTIME


def select_graph(manifest: dict, backend: str, engine_dir: Path) -> dict:
    """The target-role graph entry `backend` runs: its own graph, else (onnxruntime) the portable tensorrt one."""
    if backend not in ef.BACKENDS:
        raise SpecbuildError(f"unknown backend {backend!r}; choose {' or '.join(ef.BACKENDS)}")
    graphs = {g["backend"]: g for g in manifest["graphs"] if g["role"] == ef.ROLE_TARGET}
    graph = graphs.get(backend) or (graphs.get(ef.BACKEND_TENSORRT) if backend == ef.BACKEND_ONNXRUNTIME else None)
    if graph is None:
        built = ", ".join(sorted(graphs)) or "(none)"
        raise SpecbuildError(
            f"{engine_dir}: the engine has no graph for the {backend} backend (built for: {built}); rebuild it with "
            f"--backends including {backend}"
        )
    return graph


def backend_class(backend: str) -> type[Backend]:
    """The class of `backend`, imported now (TensorRT's only when asked for)."""
    if backend == ef.BACKEND_ONNXRUNTIME:
        from specbuild.runtime.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend
    if backend == ef.BACKEND_TENSORRT:
        from specbuild.runtime.backends.tensorrt import TensorRTBackend

        return TensorRTBackend
    raise SpecbuildError(f"unknown backend {backend!r}; choose {' or '.join(ef.BACKENDS)}")


def create_backend(
    engine_dir: Path,
    manifest: dict,
    backend: str | None = None,
    threads: int = 0,
    graph: dict | None = None,
    shared_cores: bool = False,
) -> Backend:
    """threads: resolved (base.resolve_threads; 0 = the backend's default). shared_cores: this session runs between
    the calls of another one (a draft model's between its target's): its threads must not busy-wait after a call."""
    backend = backend or default_backend(manifest)
    graph = graph or select_graph(manifest, backend, Path(engine_dir))
    return backend_class(backend)(Path(engine_dir), manifest, graph, threads, shared_cores)
