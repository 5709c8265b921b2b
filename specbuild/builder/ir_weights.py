"""Weights of an exported step graph made when the graph is written, not when it is exported.

The exporter sees the skeleton network (builder/lazy_network.py): its decoder-layer parameters are fake, so the
exported model's initializers for them hold no data. `make_lazy` gives each of them its value as an onnx_ir
LazyTensor that reads the parameter from the checkpoint when the file is written (`save`, one tensor at a time, with
a bound on the bytes in flight), and folds the weight transposes the exporter leaves (nn.Linear -> Transpose(W) ->
MatMul) into those lazy values, as the exporter's optimizer folds a real weight's: same graph, same names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from specbuild.progress import steps

STEP_PREFIX = "net."  # where the step module keeps the network (builder/step.py): its parameters' name prefix
IN_FLIGHT_BYTES = 256 * 1024**2  # what save may hold at once, beyond the tensor it is writing
ALIGN = 64  # bytes: where each tensor starts in the data file (builder/weights_file.py: ALIGN)


def _is_fake(value: ir.Value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(getattr(value.const_value, "raw", None), FakeTensor)


def _ir_dtype(dtype: torch.dtype) -> ir.DataType:
    return {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16}[dtype]


def make_lazy(model: ir.Model, weight: Callable[[str], torch.Tensor]) -> int:
    """Give every fake initializer of `model` its value from weight(name in the network), read when it is written;
    fold each lone Transpose of one into it. Returns how many there were."""
    graph = model.graph
    fakes = [value for value in graph.initializers.values() if _is_fake(value)]
    for value in fakes:
        name = value.name
        if not name.startswith(STEP_PREFIX):
            raise ValueError(f"initializer {name} has no data and is not a parameter of the network")
        raw = value.const_value.raw
        source = _reader(weight, name.removeprefix(STEP_PREFIX), None)
        lazy = ir.LazyTensor(source, dtype=_ir_dtype(raw.dtype), shape=ir.Shape(tuple(raw.shape)), name=name)
        value.const_value = lazy
        _fold_transpose(graph, value, weight)
    return len(fakes)


def _reader(weight: Callable[[str], torch.Tensor], name: str, perm: list[int] | None):
    def read() -> ir.Tensor:
        tensor = weight(name).detach()
        if perm is not None:
            tensor = tensor.permute(perm)
        return ir.Tensor(np.ascontiguousarray(tensor.numpy()))

    return read


def _fold_transpose(graph: ir.Graph, value: ir.Value, weight) -> None:
    """A lazy weight read only by one Transpose becomes the transposed weight under the Transpose's output name."""
    uses = list(value.uses())
    if len(uses) != 1:
        return
    node = uses[0].node
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
        return
    perm = list(node.attributes["perm"].as_ints())
    out = node.outputs[0]
    lazy = value.const_value
    shape = ir.Shape([lazy.shape[p] for p in perm])
    name = out.name
    folded = ir.Value(name=f"{name}.folding", shape=shape, type=ir.TensorType(lazy.dtype))
    folded.const_value = ir.LazyTensor(
        _reader(weight, value.name.removeprefix(STEP_PREFIX), perm), dtype=lazy.dtype, shape=shape, name=name
    )
    out.replace_all_uses_with(folded, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    graph.initializers.pop(value.name)
    folded.name = name
    graph.register_initializer(folded)


def save(model: ir.Model, path: Path, description: str, log=None) -> None:
    """Write `model` to `path` with its tensors in `path`.data, each made (lazy weights) and written in turn."""
    sizes = [v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None]
    with steps(description, len(sizes), log=log) as advance:
        ir.save(
            model,
            path,
            external_data=f"{Path(path).name}.data",
            size_threshold_bytes=1024,
            callback=lambda tensor, info: advance(),
            max_in_flight_bytes=IN_FLIGHT_BYTES,
            alignment=ALIGN,  # as the engine's weights file aligns them (weights_file.py): it can be adopted as is
            align_threshold=0,
        )
