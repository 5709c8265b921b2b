"""Whether this machine can hold the engine a build would write, said before any work (one line, with what would fit).

Running an engine holds its weights (ONNX Runtime maps them) plus a working set; so does a quantized build's check of
the whole graph on a prompt. A float build itself holds less (the float weights of the whole model are never held,
builder/network/lazy_network.py, and its graph is checked in segments, builder/export/graph_segments.py), but an engine
this machine cannot run is not worth writing. So the estimate is the weights of the engine at its precision plus a
bounded working set (a few decoder layers in float, the largest tensor), against the memory the machine has available
now.
"""

from __future__ import annotations

from collections.abc import Mapping

from specbuild.errors import SpecbuildError
from specbuild.host_memory import available_bytes  # noqa: F401  (plan.py reads it from here)

PRECISIONS = ("fp32", "fp16", "int8", "int4")
FLOAT_BYTES = {"fp32": 4, "fp16": 2, "int8": 4, "int4": 4}  # the float parts of the engine (norms, int8's embedding)
WORKING_SET_LAYERS = 4  # float decoder layers' worth of working memory on top of the weights (export, checks)


def quantized_bytes_per_weight(weights: str, block_size: int) -> float:
    """Bytes one matmul weight takes in the engine: the value plus its block's float32 scale (and int4's packed
    zero point)."""
    if weights == "int4":
        return 0.5 + (4 + 0.5) / block_size
    if weights == "int8":
        return 1 + (4 + 1) / block_size
    return FLOAT_BYTES[weights]


def engine_bytes(tensors: Mapping, shapes, weights: str, block_size: int, tied: bool) -> int:
    """The weights of the base network's engine at `weights`: the decoder layers' and the lm_head's matmuls at their
    precision, the embedding float except at int4 (an INT4 gather), norms float. `shapes(name)` gives a shape."""
    per_weight = quantized_bytes_per_weight(weights, block_size)
    total = 0.0
    for name in tensors:
        shape = shapes(name)
        count = 1
        for dim in shape:
            count *= int(dim)
        if name == "model.embed_tokens.weight":
            total += count * (per_weight if weights == "int4" else FLOAT_BYTES[weights])
            if tied:  # the graph's lm_head is a matmul of its own over the same rows
                total += count * per_weight
        elif len(shape) == 2:
            total += count * per_weight
        else:
            total += count * FLOAT_BYTES[weights]
    return int(total)


def working_set_bytes(tensors: Mapping, shapes, weights: str) -> int:
    """What the build holds beside the engine's weights: a few float decoder layers and the largest tensor."""
    layer, largest = 0, 0
    for name in tensors:
        count = 1
        for dim in shapes(name):
            count *= int(dim)
        count *= FLOAT_BYTES[weights]
        largest = max(largest, count)
        if name.startswith("model.layers.0."):
            layer += count
    return WORKING_SET_LAYERS * layer + 2 * largest


def check_fits(tensors: Mapping, shapes, weights: str, block_size: int, tied: bool, available: int | None) -> dict:
    """Refuse (one line) a build whose engine and working set exceed `available` bytes, naming the precisions that
    would fit. Returns the estimate {precision: bytes} of the engine at every precision."""
    sizes = {p: engine_bytes(tensors, shapes, p, block_size, tied) for p in PRECISIONS}
    need = sizes[weights] + working_set_bytes(tensors, shapes, weights)
    if available is None or need <= available:
        return sizes
    fits = [
        f"--weights {p} ({_gb(sizes[p])})"
        for p in PRECISIONS
        if sizes[p] + working_set_bytes(tensors, shapes, p) <= available
    ]
    instead = f"; {' or '.join(fits)} would fit" if fits else "; no precision fits: free memory or use a larger machine"
    raise SpecbuildError(
        f"--weights {weights}: the engine holds {_gb(sizes[weights])} of weights and running it needs about "
        f"{_gb(need)}, more than the {_gb(available)} this machine has available{instead}"
    )


def _gb(count: int) -> str:
    return f"{count / 1e9:.1f} GB"
