"""Weights of an exported step graph made when the graph is written, not when it is exported.

The exporter sees the skeleton network (builder/network/lazy_network.py): its decoder-layer parameters are fake, so the
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

from specbuild.builder.export.weights_file import ALIGN, INLINE_BELOW
from specbuild.progress import steps

STEP_PREFIX = "net."  # where the step module keeps the network (builder/network/step.py): its parameters' name prefix
IN_FLIGHT_BYTES = 256 * 1024**2  # what save may hold at once, beyond the tensor it is writing
WRITERS = 2  # threads making tensors while the graph is written (torch and the quantizer release the GIL)


def _is_fake(value: ir.Value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(getattr(value.const_value, "raw", None), FakeTensor)


def _ir_dtype(dtype: torch.dtype) -> ir.DataType:
    return {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16}[dtype]


def make_lazy(model: ir.Model, weight: Callable[[str], torch.Tensor] | None, ahead=None) -> int:
    """Give every fake initializer of `model` its value from weight(name in the network), read when it is written;
    fold each lone Transpose of an initializer into it (as the exporter's optimizer would: the quantizer then finds
    the weights of the mode's own matmuls too). ahead (weights_ahead.WeightsAhead): an initializer it wrote in the
    layout the graph takes points at those bytes instead. Returns how many fake initializers there were."""
    graph = model.graph
    fakes = [value for value in graph.initializers.values() if _is_fake(value)]
    for value in fakes:
        name = value.name
        if weight is None or not name.startswith(STEP_PREFIX):
            raise ValueError(f"initializer {name} has no data and is not a parameter of the network")
        raw = value.const_value.raw
        dtype = _ir_dtype(raw.dtype)

        def make(perm, shape, as_name, name=name, dtype=dtype):
            return _written(ahead, name, perm, shape, dtype, as_name) or ir.LazyTensor(
                _reader(weight, name.removeprefix(STEP_PREFIX), perm), dtype=dtype, shape=shape, name=as_name
            )

        _place(graph, value, ir.Shape(tuple(raw.shape)), dtype, make)
    for value in list(graph.initializers.values()):  # the mode's own weights (real): folded the same way
        if value not in fakes and value.const_value is not None:
            tensor = value.const_value

            def make(perm, shape, as_name, name=value.name, tensor=tensor):
                written = _written(ahead, name, perm, shape, tensor.dtype, as_name)
                if written is not None or perm is None:
                    return written or tensor
                return ir.LazyTensor(_transposed(tensor, perm), dtype=tensor.dtype, shape=shape, name=as_name)

            _place(graph, value, tensor.shape, tensor.dtype, make)
    return len(fakes)


def _written(ahead, name: str, perm, shape: ir.Shape, dtype: ir.DataType, as_name: str) -> ir.TensorProtocol | None:
    """Initializer `name` in layout perm as `ahead` wrote it (an external tensor in its file), or None."""
    if ahead is None:
        return None
    entry = ahead.claim(name, perm, tuple(shape), dtype.numpy())
    return None if entry is None else ahead.external(entry, dtype, shape, as_name)


def _transposed(tensor: ir.TensorProtocol, perm: list[int]):
    def read() -> ir.Tensor:
        array = tensor.numpy()
        if array.dtype in (np.float32, np.float16) and array.flags.writeable:  # torch's blocked transpose, as _reader's
            return ir.Tensor(torch.from_numpy(array).permute(perm).contiguous().numpy())
        return ir.Tensor(np.ascontiguousarray(array.transpose(perm)))

    return read


def _reader(weight: Callable[[str], torch.Tensor], name: str, perm: list[int] | None):
    def read() -> ir.Tensor:
        tensor = weight(name).detach()
        if perm is not None:  # torch's blocked transpose, faster than numpy's on a [V,H] embedding
            tensor = tensor.permute(perm).contiguous()
        return ir.Tensor(np.ascontiguousarray(tensor.numpy()))

    return read


def _place(graph: ir.Graph, value: ir.Value, shape: ir.Shape, dtype: ir.DataType, make) -> None:
    """Give initializer `value` its tensor make(perm, stored shape, name): where it is read only by Transposes of one
    permutation (a layer the graph applies several times has one per use, in the main graph or in an If branch) the
    transposed weight under the first Transpose's output name, read where each of them was; else make(None, ...)."""
    nodes = list(dict.fromkeys(use.node for use in value.uses()))  # in the main graph or an If branch
    perms = {tuple(node.attributes["perm"].as_ints()) for node in nodes if node.op_type == "Transpose"}
    if not nodes or len(perms) != 1 or any(node.op_type != "Transpose" or node.domain not in ("", "ai.onnx")
                                           for node in nodes):  # fmt: skip
        value.const_value = make(None, shape, value.name)
        return
    perm = list(perms.pop())
    folded_shape = ir.Shape([shape[p] for p in perm])
    name = nodes[0].outputs[0].name
    folded = ir.Value(name=f"{name}.folding", shape=folded_shape, type=ir.TensorType(dtype))
    folded.const_value = make(perm, folded_shape, name)
    for node in nodes:
        node.outputs[0].replace_all_uses_with(folded, replace_graph_outputs=True)
        node.graph.remove(node, safe=True)
    graph.initializers.pop(value.name)
    folded.name = name
    graph.register_initializer(folded)


def save(model: ir.Model, path: Path, description: str, log=None, ahead=None) -> None:
    """Write `model` to `path` with its tensors in `path`.data, each made (lazy weights) and written in turn; those
    `ahead` wrote (weights_ahead.WeightsAhead, make_lazy pointed them there) stay where they are, the rest follow
    them. Where some it wrote were not taken by the graph, everything is written again, packed."""
    if ahead is not None and not ahead.unclaimed():
        _save_after(model, path, ahead, description, log)
        return
    if ahead is not None:
        ahead.finish()
        if log is not None:
            log(f"{path.name}: {len(ahead.unclaimed())} weight(s) written ahead in a layout the graph does not take "
                f"(first: {ahead.unclaimed()[0]}); writing its weights again")  # fmt: skip
    sizes = [v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None]
    with steps(description, len(sizes), log=log) as advance:
        ir.save(
            model,
            path,
            external_data=f"{Path(path).name}.data",
            size_threshold_bytes=INLINE_BELOW,
            callback=lambda tensor, info: advance(),
            max_in_flight_bytes=IN_FLIGHT_BYTES,
            max_workers=WRITERS,  # tensors made (read, transposed, quantized) in parallel, written in order
            # onnx_ir starts each tensor on a page (max(4096, alignment)), which the engine's weights file allows
            # (weights_file.py): the data file can be adopted as is
            alignment=ALIGN,
            align_threshold=0,
        )


def _save_after(model: ir.Model, path: Path, ahead, description: str, log=None) -> None:
    """save's way where every weight `ahead` wrote is the graph's: the other tensors over INLINE_BELOW bytes written
    after them by its threads, each on a page as save places them, then the graph."""
    import onnx

    from specbuild.runtime import integrity

    rest = [
        value
        for graph in model.graphs()
        for value in graph.initializers.values()
        if value.const_value is not None
        and not isinstance(value.const_value, ir.ExternalTensor)
        and value.const_value.nbytes > INLINE_BELOW
    ]
    placed = ahead.append([value.const_value for value in rest])
    with steps(description, len(ahead.entries) + len(placed), log=log) as advance:
        ahead.finish(advance)
    for value, entry in zip(rest, placed):
        tensor = value.const_value
        value.const_value = ir.ExternalTensor(ahead.path.name, entry.offset, entry.length, tensor.dtype,
                                              shape=tensor.shape, name=tensor.name or value.name,
                                              base_dir=ahead.path.parent)  # fmt: skip
    if ahead.sha256 is not None:  # the engine's checksum of this file, taken as it was written
        integrity.remember_written(ahead.path, ahead.sha256)
    onnx.save(ir.serde.serialize_model(model), str(path))
