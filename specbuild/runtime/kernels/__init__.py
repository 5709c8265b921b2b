"""specbuild's own CPU kernels, an ONNX Runtime custom-operator library compiled from the sources in src/ on the
machine that runs the engine (build.py), with a graph rewrite that hands them an engine graph's matmuls (rewrite.py).

BlockInt4MatMul runs the 4-bit weight matmuls of int4 engines (`--weights int4`), with int8 activations
(`--int8-activations`) or float ones: ONNX Runtime's own kernels stream the weights once per pair of rows (int8
activations) or dequantize the whole weight for a call of two rows or more (float activations), so a call's cost
grows with its rows; this one streams them once per call and gives every row the same bits whatever the call's
other rows and whatever the CPU's instruction set (AVX-512, AVX2 or none: one arithmetic). OrderedAttention runs the
attention of engines with int8 activations or an int8 KV cache: every row reduces the keys it sees in position
order, so a tree node gets the bits one-token decoding gives the same token, and branching trees stay exact at those
precisions. Where no compiler, no headers or no writable cache is at hand, or SPECBUILD_KERNELS=off, engines run on
ONNX Runtime's stock kernels (the graph as built) and the runtime says so once. The measurements behind it:
docs/benchmarks/design-measurements.md (runtime/kernels); how it binds to ONNX Runtime: docs/engine-format.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import sys
from pathlib import Path

from specbuild.errors import SpecbuildError

ENV = "SPECBUILD_KERNELS"  # "off": the stock kernels
_STOCK = contextvars.ContextVar("specbuild_stock_kernels", default=False)


@contextlib.contextmanager
def stock():
    """Engines loaded inside run on ONNX Runtime's stock kernels whatever this machine can build (`bench
    --stock-kernels`: the same engine on both, side by side)."""
    token = _STOCK.set(True)
    try:
        yield
    finally:
        _STOCK.reset(token)


@functools.lru_cache(maxsize=1)
def _library() -> tuple[Path | None, str]:
    """(the built library or None, how the engines run: its instruction set, or why the stock kernels)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no"):
        return None, f"ONNX Runtime's stock kernels ({ENV}=off)"
    from specbuild.runtime.kernels import build

    try:
        path = build.build()
        isa = ctypes.CDLL(str(path)).SpecbuildKernelsIsa
        isa.restype = ctypes.c_char_p
        return path, f"specbuild kernels ({isa().decode()})"
    except (SpecbuildError, OSError) as exc:
        reason = f"ONNX Runtime's stock kernels: the specbuild kernels are not available ({exc})"
        print(f"note: {reason}", file=sys.stderr)  # once per process
        return None, reason


def _in_use() -> tuple[Path | None, str]:
    return (None, "ONNX Runtime's stock kernels (asked for)") if _STOCK.get() else _library()


def library() -> Path | None:
    """The kernel library, built on first use (None: the stock kernels serve; `description` says why)."""
    return _in_use()[0]


def description() -> str:
    """Which kernels the engines loaded now run on, in words."""
    return _in_use()[1]


def tag() -> str:
    """What the kernels in use are, for the keys of what is measured with them (cost curves, row invariance)."""
    path = library()
    return "stock" if path is None else f"specbuild-{path.parent.name}-{description()}"


def wanted(graph: dict) -> tuple[str | None, bool]:
    """(matmuls, attention): which of an engine graph's kernels (engine.yaml's graphs[] entry) specbuild's kernels
    take where they are available -- the int4 matmuls, with "int8" activations in a graph with int8 activations
    (accuracy level 4) and "float" ones in a graph with float activations (None: no int4 weights), and the attention
    of a graph with int8 activations or an int8 KV cache (where the roundings after attention would turn the stock
    kernel's column-order sums into other tokens)."""
    from specbuild import engine_format as ef
    from specbuild.runtime.kernels.rewrite import FLOAT, INT8

    quantization = graph.get("quantization") or {}
    int8_activations = int(quantization.get("accuracy_level", 1)) == ef.ACCURACY_INT8
    int4 = int(quantization.get("bits", 0)) == 4
    kv_int8 = graph.get(ef.GRAPH_KV_CACHE_DTYPE, ef.KV_CACHE_FLOAT) == ef.KV_CACHE_INT8
    matmuls = INT8 if int8_activations else FLOAT if int4 else None
    return matmuls, int8_activations or kv_int8


def session_source(model_path: Path, options, graph: dict):
    """What an ONNX Runtime session of `model_path` (engine.yaml's `graph` entry) loads: the graph rewritten for the
    kernel library (its bytes, with `options` made to register the library and to find the weights beside the file)
    where the library is available and the graph has kernels it takes (`wanted`), else the file's path as it is."""
    matmuls, attention = wanted(graph)
    if not (matmuls or attention) or library() is None:
        return str(model_path)
    import onnx

    from specbuild.runtime.kernels.rewrite import use_kernels

    model = onnx.load(str(model_path), load_external_data=False)
    if not use_kernels(model, matmuls=matmuls, attention=attention):
        return str(model_path)
    register(options)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model_path.parent))
    return model.SerializeToString()


def register(options) -> None:
    """Make `options` load the kernel library (a session whose graph holds its ops)."""
    options.register_custom_ops_library(str(library()))
