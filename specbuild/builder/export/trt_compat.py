"""Static check that an ONNX graph will import with TensorRT's ONNX parser, without needing TensorRT.

The operator matrix (supported ops, input types, build-time-constant inputs, opset range) lives in
``specbuild/data/tensorrt_onnx_ops.yaml``, transcribed from onnx-tensorrt's ``docs/operators.md`` for the
TensorRT version named there. :func:`lint_onnx_for_tensorrt` returns one line per problem;
:func:`assert_tensorrt_clean` raises :class:`SpecbuildError` listing them. Every build runs the check so that a
graph that would fail ``--tensorrt`` on a GPU host is caught on CPU too.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto

from specbuild.errors import SpecbuildError

_DEFAULT_DOMAINS = ("", "ai.onnx")
_RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}
_TOPK_MAX_K = 3840

# ONNX element type -> the names used in the operator matrix. DOUBLE is cast down to FLOAT by the parser.
_TYPE_NAMES = {
    TensorProto.FLOAT: "FP32",
    TensorProto.DOUBLE: "FP32",
    TensorProto.FLOAT16: "FP16",
    TensorProto.BFLOAT16: "BF16",
    TensorProto.INT32: "INT32",
    TensorProto.INT64: "INT64",
    TensorProto.INT8: "INT8",
    TensorProto.UINT8: "UINT8",
    TensorProto.BOOL: "BOOL",
    TensorProto.FLOAT8E4M3FN: "FP8",
    TensorProto.INT4: "INT4",
}


@lru_cache(maxsize=1)
def operator_matrix() -> dict[str, Any]:
    """The parsed tensorrt_onnx_ops.yaml (version, source URL, opset range, supported/unsupported ops)."""
    import yaml

    text = resources.files("specbuild").joinpath("data", "tensorrt_onnx_ops.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in str(version).split(".") if p.isdigit())


def _type_name(elem_type: int) -> str:
    return _TYPE_NAMES.get(elem_type) or TensorProto.DataType.Name(elem_type)


def _node_label(node: onnx.NodeProto, index: int, where: str) -> str:
    name = node.name or f"#{index}"
    op = f"{node.domain}::{node.op_type}" if node.domain not in _DEFAULT_DOMAINS else node.op_type
    return f"node {name!r} ({op}{where})"


class _Scope:
    """Types and build-time constants visible in one graph (inherits the enclosing graph's)."""

    def __init__(self, graph: onnx.GraphProto | None, outer: _Scope | None = None):
        self.types: dict[str, int] = dict(outer.types) if outer else {}
        self.consts: dict[str, onnx.TensorProto | None] = dict(outer.consts) if outer else {}
        if graph is None:
            return
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                self.types[vi.name] = vi.type.tensor_type.elem_type
        for init in graph.initializer:
            self.types[init.name] = init.data_type
            self.consts[init.name] = init
        for graph_input in graph.input:  # an initializer that is also a graph input is only a default
            self.consts.pop(graph_input.name, None)

    def note_node(self, node: onnx.NodeProto) -> None:
        if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            for out in node.output:
                self.consts[out] = value
        elif node.op_type not in _RANDOM_OPS and node.input and all(not i or i in self.consts for i in node.input):
            has_subgraph = any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
            )
            if not has_subgraph:
                for out in node.output:
                    self.consts.setdefault(out, None)  # constant-foldable, value unknown here

    def const_value(self, name: str):
        tensor = self.consts.get(name)
        if tensor is None or tensor.data_location == TensorProto.EXTERNAL:
            return None
        from onnx import numpy_helper

        return numpy_helper.to_array(tensor)


def _check_graph(
    graph: onnx.GraphProto,
    scope: _Scope,
    problems: list[str],
    where: str,
    oldest: tuple[int, ...] | None,
    functions: frozenset[tuple[str, str]] = frozenset(),
) -> None:
    matrix = operator_matrix()
    supported: dict[str, dict] = matrix["supported"]
    unsupported: dict[str, str] = matrix["unsupported"]
    trt = f"TensorRT {matrix['tensorrt_version']}"
    for index, node in enumerate(graph.node):
        label = _node_label(node, index, where)
        op = node.op_type
        if (node.domain, op) in functions:
            pass  # a call to a model-local function: the parser expands it; its body is checked separately
        elif node.domain not in _DEFAULT_DOMAINS:
            problems.append(
                f"{label} is in non-standard domain {node.domain!r}; {trt}'s ONNX parser imports standard ONNX ops only"
            )
        elif op in unsupported:
            why = unsupported[op]
            problems.append(f"{label}: {trt}'s ONNX parser does not support {op}" + (f" ({why})" if why else ""))
        elif op not in supported:
            problems.append(f"{label}: {op} is not in {trt}'s ONNX operator list")
        else:
            _check_node(node, label, supported[op], scope, problems, trt, oldest)
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subgraphs:
                sub_where = f"{where}, in {op} subgraph {attr.name!r}"
                _check_graph(sub, _Scope(sub, scope), problems, sub_where, oldest, functions)
        scope.note_node(node)


def _check_node(
    node: onnx.NodeProto,
    label: str,
    spec: dict,
    scope: _Scope,
    problems: list[str],
    trt: str,
    oldest: tuple[int, ...] | None,
) -> None:
    op = node.op_type
    since = spec.get("since")
    if oldest is not None and since and _version_tuple(since) > oldest:
        problems.append(
            f"{label}: {op} needs TensorRT {since} or newer, but the oldest target is {'.'.join(map(str, oldest))}"
        )
    type_input = spec.get("type_input", 0)
    if type_input is not None and type_input < len(node.input) and node.input[type_input]:
        name = node.input[type_input]
        elem = scope.types.get(name)
        if elem:
            tname = _type_name(elem)
            if tname not in spec["types"]:
                problems.append(
                    f"{label}: input {name!r} is {tname} but {trt} supports {op} only on {', '.join(spec['types'])}"
                )
    for idx in spec.get("const_inputs", []) or []:
        if idx < len(node.input) and node.input[idx] and node.input[idx] not in scope.consts:
            problems.append(
                f"{label}: input {node.input[idx]!r} (index {idx}) must be a build-time constant for TensorRT "
                "(fold constants, e.g. `polygraphy surgeon sanitize --fold-constants`)"
            )
    if op == "TopK":
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("sorted", 1) != 1:
            problems.append(f"{label}: TensorRT requires TopK sorted=1")
        if len(node.input) > 1:
            k = scope.const_value(node.input[1])
            if k is not None and k.size == 1 and int(k.reshape(-1)[0]) >= _TOPK_MAX_K:
                problems.append(f"{label}: TopK K={int(k.reshape(-1)[0])} but TensorRT needs K < {_TOPK_MAX_K}")


def _load(model: onnx.ModelProto | str | Path) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        return onnx.load(str(model), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - any load failure is a user-facing bad file
        raise SpecbuildError(f"cannot read ONNX model {str(model)!r}: {exc}") from None


def lint_onnx_for_tensorrt(
    model: onnx.ModelProto | str | Path,
    *,
    max_opset: int | None = None,
    oldest_tensorrt: str | None = None,
) -> list[str]:
    """Problems that would stop TensorRT's ONNX parser from importing ``model`` (empty list when clean).

    Checks: default-domain opset within the matrix's range (``max_opset`` narrows it), every op in the
    operator list (model-local functions are inlined first, If/Loop/Scan subgraphs are walked), no
    non-standard domains, data-input types within each op's supported types (e.g. CumSum float only; types
    come from ONNX shape inference), inputs that must be build-time constants, TopK's restrictions and,
    when ``oldest_tensorrt`` is given (e.g. "10.1"), ops newer than that TensorRT version.
    """
    matrix = operator_matrix()
    proto = _load(model)
    problems: list[str] = []
    trt = f"TensorRT {matrix['tensorrt_version']}"
    lo, hi = int(matrix["opset_min"]), int(matrix["opset_max"])
    if max_opset is not None:
        hi = min(hi, int(max_opset))
    for entry in proto.opset_import:
        if entry.domain in _DEFAULT_DOMAINS and not lo <= entry.version <= hi:
            problems.append(
                f"model uses ONNX opset {entry.version} but {trt}'s parser supports opsets {lo} to {hi} "
                f"({matrix['source_url']})"
            )
    inliner = getattr(onnx, "inliner", None)
    if proto.functions and inliner is not None:
        try:
            proto = inliner.inline_local_functions(proto)
        except Exception:  # noqa: BLE001 - fall back to checking function bodies separately
            pass
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - types are best effort; unknown types are not flagged
        inferred = proto
    oldest = _version_tuple(oldest_tensorrt) if oldest_tensorrt else None
    functions = frozenset((f.domain, f.name) for f in inferred.functions)
    _check_graph(inferred.graph, _Scope(inferred.graph), problems, "", oldest, functions)
    for func in inferred.functions:
        _check_graph(func, _Scope(None), problems, f", in function {func.domain}::{func.name}", oldest, functions)
    return problems


def assert_tensorrt_clean(model: onnx.ModelProto | str | Path, *, max_problems: int = 10, **kwargs) -> None:
    """Raise SpecbuildError listing the problems :func:`lint_onnx_for_tensorrt` finds, if any."""
    problems = lint_onnx_for_tensorrt(model, **kwargs)
    if not problems:
        return
    shown = "; ".join(problems[:max_problems])
    more = f"; and {len(problems) - max_problems} more" if len(problems) > max_problems else ""
    raise SpecbuildError(f"ONNX graph is not TensorRT-compatible ({len(problems)} problems): {shown}{more}")
