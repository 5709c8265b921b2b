"""`build --weights int8 --int8-activations`: each base matmul as an integer GEMM, exact and row-invariant.

A MatMul(x [..., K], W [K, N]) becomes, in the ONNX Runtime graph (7 nodes, and a Shape and an Expand per graph and
rows shape):

    s = Max(ReduceMax(|x|, last axis) / 127, tiny)         [..., 1]   one scale per row (token)
    q = QuantizeLinear(x, s, 128, block_size K)             [..., K]   the row in 8 bits around 128 (round half to
                                                                        even, 1..255; the zero point, an Expand of
                                                                        128 to s's shape, is shared by the matmuls
                                                                        whose inputs have the same rows)
    y = MatMulIntegerToFloat(q, Wq, 1, w_scale, 128) * s    [..., N]   Wq int8 [K, N], w_scale [N] per column

QuantizeLinear with one block per row (opset 21: the pass moves the graph there first) makes q in one pass over x
where Div, Add and Cast took three (q = Cast<uint8>(x / s + 128.5), round half up): cheaper calls and prompts
(docs/benchmarks/design-measurements.md).

Why this form (measured: docs/benchmarks/design-measurements.md): ONNX Runtime's MatMulInteger with uint8 activations
and int8 weights runs MLAS's quantized GEMM (AMX, AVX-512 VNNI, AVX2 kernels), whose cost is nearly flat from 1 to 16
rows, where MatMulNBits' int8-activation kernel grows with the rows. Its own DynamicQuantizeMatMul quantizes the
activations with one scale per call, so a token's result would depend on the call's other tokens; here every quantity is
per row or per element and the GEMM accumulates in int32 exactly (its float epilogue, acc * w_scale[n], is per element):
a token's bits do not depend on the rows beside it, on any CPU.

The weights use WEIGHT_LEVELS (63, 7 bits) per side: the AVX2 u8 x s8 kernel adds pairs of products in 16 bits with
saturation (255 * 127 * 2 overflows, 255 * 63 * 2 does not), so with 7-bit weights the integer result is the same on
every CPU kind and the quality measured at build holds wherever the engine runs.

The pass over a graph is quantize.integer_matmuls: weights quantized one at a time when the graph is written, as the
block quantizers' are (this module holds the arithmetic and the nodes, and imports nothing of the builder).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

ACTIVATION_LEVELS = 127  # |q - 128| <= 127: the row's largest magnitude maps to 127
ZERO_POINT = 128
WEIGHT_LEVELS = 63  # |Wq| <= 63: no 16-bit saturation in the AVX2 kernel (see the module)
TINY_SCALE = 1e-30  # the scale of an all-zero row (padding): any positive value gives q = 128
QUANTIZE_OPSET = 21  # QuantizeLinear with blocks (block_size): one scale per row
MSFT = "com.microsoft"


def quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Wq int8 [K, N], w_scale float32 [N]) of `weight` [K, N], symmetric per column."""
    w = weight.astype(np.float32, copy=False)
    scale = np.abs(w).max(axis=0) / np.float32(WEIGHT_LEVELS)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)  # a zero column: any scale
    return np.clip(np.rint(w / scale), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8), scale


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    if name not in graph.initializers:
        dtype = ir.DataType.from_numpy(array.dtype)
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(dtype))
        value.const_value = ir.Tensor(array, name=name)
        graph.register_initializer(value)
    return graph.initializers[name]


def gemm_nodes(model: ir.Model, node: ir.Node, parts: tuple[ir.Value, ir.Value], zero_points: dict) -> list[ir.Node]:
    """The nodes computing `node`'s MatMul from its input and the quantized weight `parts` (Wq, w_scale); the last
    one's output replaces the MatMul's. The model is at opset QUANTIZE_OPSET or later. zero_points: the activations'
    zero-point tensors made so far, by rows (see `_rows_key`), reused by later matmuls of the same graph."""
    root, prefix, x = model.graph, node.name, node.inputs[0]
    axes = _const(root, "int8_gemm.last_axis", np.array([-1], np.int64))
    inverse = _const(root, "int8_gemm.inverse_levels", np.array(1 / ACTIVATION_LEVELS, np.float32))
    tiny = _const(root, "int8_gemm.tiny", np.array(TINY_SCALE, np.float32))
    one = _const(root, "int8_gemm.one", np.array(1, np.float32))
    zero_point = _const(root, "int8_gemm.zero_point", np.array(ZERO_POINT, np.uint8))
    steps: list[ir.Node] = []

    def add(op: str, inputs: list, name: str, attrs=(), domain: str = "") -> ir.Value:
        new = ir.Node(domain, op, inputs, list(attrs), name=f"{prefix}.{name}")
        new.outputs[0].name = f"{prefix}.{name}"  # named: an unnamed value of an If branch may take an outer name
        steps.append(new)
        return new.outputs[0]

    row_max = add("ReduceMax", [add("Abs", [x], "abs"), axes], "row_max", [ir.AttrInt64("keepdims", 1)])
    scale = add("Max", [add("Mul", [row_max, inverse], "row_scale_raw"), tiny], "row_scale")
    wq, w_scale = parts
    key = _rows_key(node.graph, x)
    shared = zero_points if key is not None else {}
    if key not in shared:  # uint8 128 in s's shape: blocked QuantizeLinear takes no broadcast zero point
        shared[key] = add("Expand", [zero_point, add("Shape", [scale], "scale_shape")], "zero_points")
    block = [ir.AttrInt64("axis", -1), ir.AttrInt64("block_size", int(wq.shape[0]))]
    q = add("QuantizeLinear", [x, scale, shared[key]], "q", block)
    gemm = add("MatMulIntegerToFloat", [q, wq, one, w_scale, zero_point], "gemm", domain=MSFT)
    add("Mul", [gemm, scale], "out")
    return steps


def _rows_key(graph: ir.Graph, x: ir.Value):
    """What identifies x's rows (every axis but the last) within its graph, or None where its shape is not fully
    named: two matmuls whose inputs share the key share the zero-point tensor."""
    if x.shape is None or any(not isinstance(d, int) and d.value is None for d in x.shape[:-1]):
        return None
    return id(graph), tuple(str(d) for d in x.shape[:-1])
