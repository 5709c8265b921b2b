"""A large ONNX graph run piece by piece: its nodes, in their stored (topological) order, cut into segments whose
weights stay within a budget, each loaded as an ONNX Runtime session of its own, run on every call and let go before
the next, so that running the whole graph holds about one segment's weights rather than all of them.

Each segment is a graph of its own, written beside the graph (its initializers keep their external data there)
while it runs: its inputs are the graph inputs and the values of earlier segments it reads (If/Loop bodies' outer
names included), its outputs the graph outputs it makes and the values later segments read. The values crossing a
cut are a step's activations (a few tokens), small beside the weights."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto, helper


@dataclass
class Segment:
    """A run of consecutive nodes of the graph and the names at its edges."""

    nodes: list[NodeProto] = field(default_factory=list)
    initializers: list[str] = field(default_factory=list)  # the graph's initializers its nodes read
    weight_bytes: int = 0
    inputs: list[str] = field(default_factory=list)  # graph inputs and earlier segments' values it reads
    outputs: list[str] = field(default_factory=list)  # graph outputs it makes and values later segments read


def initializer_bytes(tensor: TensorProto) -> int:
    """The bytes of an initializer's data, stored inside the proto or outside it."""
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    if tensor.data_location == TensorProto.EXTERNAL:  # no length recorded: its element count times their size
        count = int(np.prod(tensor.dims, dtype=np.int64))
        return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return tensor.ByteSize()


def _reads(node: NodeProto) -> list[str]:
    """The names `node` reads: its inputs and the outer-scope names its subgraphs (If, Loop, Scan bodies) read."""
    names = [n for n in node.input if n]
    for attr in node.attribute:
        for body in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            names += _outer_reads(body)
    return names


def _outer_reads(graph: GraphProto) -> list[str]:
    """The names a subgraph reads that it does not define itself."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    reads = []
    for node in graph.node:
        reads += [n for n in _reads(node) if n not in defined]
        defined.update(node.output)
    reads += [o.name for o in graph.output if o.name not in defined]
    return reads


def plan_segments(graph: GraphProto, budget: int) -> list[Segment]:
    """The graph's nodes in order, cut where a segment's weights would pass `budget` bytes (a node whose own weights
    pass it is a segment of its own)."""
    sizes = {t.name: initializer_bytes(t) for t in graph.initializer}
    segments, current = [], Segment()
    for node in graph.node:
        weights = [n for n in dict.fromkeys(_reads(node)) if n in sizes]
        new = [n for n in weights if n not in current.initializers]
        if current.nodes and current.weight_bytes + sum(sizes[n] for n in new) > budget:
            segments.append(current)
            current, new = Segment(), weights
        current.nodes.append(node)
        current.initializers += new
        current.weight_bytes += sum(sizes[n] for n in new)
    if current.nodes:
        segments.append(current)
    _connect(graph, segments, set(sizes))
    return segments


def _connect(graph: GraphProto, segments: list[Segment], initializers: set[str]) -> None:
    """Each segment's inputs (what it reads from before it) and outputs (what the graph or a later one reads)."""
    made_by = {}  # value -> the segment that makes it
    for index, segment in enumerate(segments):
        for node in segment.nodes:
            for name in node.output:
                if name:
                    made_by[name] = index
    read_later: dict[int, set[str]] = {i: set() for i in range(len(segments))}
    for index, segment in enumerate(segments):
        inputs = []
        for node in segment.nodes:
            for name in _reads(node):
                if name in initializers or made_by.get(name) == index:
                    continue
                inputs.append(name)
                if name in made_by:
                    read_later[made_by[name]].add(name)
        segment.inputs = list(dict.fromkeys(inputs))
    wanted = {o.name for o in graph.output}
    for index, segment in enumerate(segments):
        made = [n for node in segment.nodes for n in node.output if n]
        segment.outputs = [n for n in made if n in wanted or n in read_later[index]]


def segment_model(model: ModelProto, segment: Segment, types: dict[str, ValueInfoProto]) -> ModelProto:
    """The ModelProto of one segment (its initializers' data stays where the graph's is); types: the declared
    ValueInfo of each value that has one (an input without one is declared by the caller, an output without one is
    left for ONNX Runtime to infer)."""
    wanted = set(segment.initializers)
    graph = helper.make_graph(
        segment.nodes,
        f"{model.graph.name}.segment",
        [types[n] for n in segment.inputs],
        [types.get(n) or ValueInfoProto(name=n) for n in segment.outputs],
        initializer=[t for t in model.graph.initializer if t.name in wanted],
    )
    out = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    out.functions.extend(model.functions)
    return out


def declared_types(model: ModelProto) -> dict[str, ValueInfoProto]:
    """The ValueInfo the graph declares for its inputs, outputs and intermediate values."""
    graph = model.graph
    return {v.name: v for v in [*graph.value_info, *graph.output, *graph.input]}


def value_info_of(name: str, array: np.ndarray) -> ValueInfoProto:
    """A ValueInfo of `name` with `array`'s element type and rank (its dimensions left free)."""
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), [None] * array.ndim)


@contextlib.contextmanager
def segment_file(directory: Path, stem: str, model: ModelProto, index: int) -> Iterator[Path]:
    """Within: `model` saved beside the graph (where its external data's paths lead), removed after."""
    path = directory / f".{stem}.segment{index}.onnx"
    onnx.save(model, str(path))
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def run_segmented(
    onnx_path: Path,
    calls: list[dict],
    budget: int,
    run_segment: Callable[[Path, list[dict], list[str]], list[dict]],
    log: Callable[[str], None] | None = None,
) -> list[dict] | None:
    """Every call's feeds through the graph at `onnx_path` segment by segment; None where it is one segment (run it
    whole). run_segment(segment file, each call's values, output names) runs one segment's session on every call and
    returns each call's outputs; a value crossing a cut is read from the earlier segment's outputs. Returns each
    call's values (its feeds and every value a segment gave)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    segments = plan_segments(model.graph, budget)
    if len(segments) <= 1:
        return None
    types = declared_types(model)
    values = [dict(feeds) for feeds in calls]
    for index, segment in enumerate(segments):
        for name in segment.inputs:
            if name not in types:  # left untyped by the export: its type and rank as an earlier segment made it
                types[name] = value_info_of(name, values[0][name])
        proto = segment_model(model, segment, types)
        with segment_file(onnx_path.parent, onnx_path.stem, proto, index) as path:
            outputs = run_segment(path, [{n: v[n] for n in segment.inputs if n in v} for v in values],
                                  segment.outputs)  # fmt: skip
        for value, got in zip(values, outputs):
            value.update(got)
        if log is not None:
            log(f"segment {index + 1}/{len(segments)} ({segment.weight_bytes / 1e6:.0f} MB of weights) run")
    return values
