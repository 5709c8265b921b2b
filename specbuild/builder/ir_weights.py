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

from specbuild.builder.weights_file import ALIGN
from specbuild.progress import steps

STEP_PREFIX = "net."  # where the step module keeps the network (builder/step.py): its parameters' name prefix
IN_FLIGHT_BYTES = 256 * 1024**2  # what save may hold at once, beyond the tensor it is writing
WRITERS = 2  # threads making tensors while the graph is written (torch and the quantizer release the GIL)


def _is_fake(value: ir.Value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(getattr(value.const_value, "raw", None), FakeTensor)


def _ir_dtype(dtype: torch.dtype) -> ir.DataType:
    return {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16}[dtype]


def make_lazy(model: ir.Model, weight: Callable[[str], torch.Tensor] | None) -> int:
    """Give every fake initializer of `model` its value from weight(name in the network), read when it is written;
    fold each lone Transpose of an initializer into it (as the exporter's optimizer would: the quantizer then finds
    the weights of the mode's own matmuls too). Returns how many fake initializers there were."""
    graph = model.graph
    fakes = [value for value in graph.initializers.values() if _is_fake(value)]
    for value in fakes:
        name = value.name
        if weight is None or not name.startswith(STEP_PREFIX):
            raise ValueError(f"initializer {name} has no data and is not a parameter of the network")
        raw = value.const_value.raw
        source = _reader(weight, name.removeprefix(STEP_PREFIX), None)
        lazy = ir.LazyTensor(source, dtype=_ir_dtype(raw.dtype), shape=ir.Shape(tuple(raw.shape)), name=name)
        value.const_value = lazy
        _fold_transpose(graph, value, lambda perm, name=name: _reader(weight, name.removeprefix(STEP_PREFIX), perm))
    for value in list(graph.initializers.values()):  # the mode's own weights (real): folded the same way
        if value not in fakes and value.const_value is not None:
            _fold_transpose(graph, value, lambda perm, tensor=value.const_value: _transposed(tensor, perm))
    return len(fakes)


def _transposed(tensor: ir.TensorProtocol, perm: list[int]):
    def read() -> ir.Tensor:
        return ir.Tensor(np.ascontiguousarray(tensor.numpy().transpose(perm)))

    return read


def _reader(weight: Callable[[str], torch.Tensor], name: str, perm: list[int] | None):
    def read() -> ir.Tensor:
        tensor = weight(name).detach()
        if perm is not None:  # torch's blocked transpose: 2-3x numpy's on a [V,H] embedding
            tensor = tensor.permute(perm).contiguous()
        return ir.Tensor(np.ascontiguousarray(tensor.numpy()))

    return read


def _fold_transpose(graph: ir.Graph, value: ir.Value, reader) -> None:
    """A weight read only by Transposes of one permutation (a layer the graph applies several times has one per
    use, in the main graph or in an If branch) becomes the transposed weight (made by reader(perm) when written)
    under the first Transpose's output name, read where each of them was."""
    nodes = list(dict.fromkeys(use.node for use in value.uses()))  # in the main graph or an If branch
    if not nodes or any(node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") for node in nodes):
        return
    perms = {tuple(node.attributes["perm"].as_ints()) for node in nodes}
    if len(perms) != 1:
        return
    perm = list(perms.pop())
    lazy = value.const_value
    shape = ir.Shape([lazy.shape[p] for p in perm])
    name = nodes[0].outputs[0].name
    folded = ir.Value(name=f"{name}.folding", shape=shape, type=ir.TensorType(lazy.dtype))
    folded.const_value = ir.LazyTensor(reader(perm), dtype=lazy.dtype, shape=shape, name=name)
    for node in nodes:
        node.outputs[0].replace_all_uses_with(folded, replace_graph_outputs=True)
        node.graph.remove(node, safe=True)
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
            max_workers=WRITERS,  # tensors made (read, transposed, quantized) in parallel, written in order
            # onnx_ir starts each tensor on a page (max(4096, alignment)), which the engine's weights file allows
            # (weights_file.py): the data file can be adopted as is
            alignment=ALIGN,
            align_threshold=0,
        )
