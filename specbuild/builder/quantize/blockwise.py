"""Weight-only quantization of step graphs (`build --weights int4|int8`, `--head-weights`), one weight at a time.

int4 (symmetric, blocks of `block_size` along K): every MatMul with a constant weight becomes DequantizeLinear
(INT4 + per-block scales, opset 21) -> MatMul. That one form serves both graphs: TensorRT's parser takes blockwise
INT4 DequantizeLinear with a zero zero-point, and ONNX Runtime fuses the pair into its MatMulNBits kernel when it
loads the graph (at the accuracy level the engine records, see below). The same weight gives the same bytes in both
graphs, so the engine stores them once (see weights_file). The embedding gather is quantized the same way (INT4 [V,H],
blocks along H): GatherBlockQuantized in the ONNX Runtime graph, DequantizeLinear -> Gather in the portable one.

int8: MatMulNBits with 8-bit blocks in the ONNX Runtime graph only (QDQ INT8 blocks are not in TensorRT's parser
matrix): `--weights int8` builds the onnxruntime graph alone. With `--int8-activations` each matmul is an exact
integer GEMM instead, weights per column and activations per row (builder/quantize/int8_gemm.py: cheaper calls of many
rows).

The passes reach every node, those of If branches included (the mode's drafting runs in one, builder/network/step.py): a
branch reads the main graph's initializers by name and gets its own DequantizeLinear of a weight it reads.

The graph is an onnx_ir model whose weights are made as it is written (builder/export/ir_weights.py) or read from its
data file: each quantized weight is a lazy value computed from its float weight when the graph is written, so a model's
float weights are never in memory together. The numerics, layouts and names are ONNX Runtime's own quantizer's
(onnxruntime.quantization.MatMulNBitsQuantizer: its block quantization kernels compute every block).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir

from specbuild import engine_format as ef
from specbuild.builder.quantize import int8_gemm
from specbuild.errors import SpecbuildError

QDQ_OPSET = 21  # blockwise DequantizeLinear and INT4 tensors
MSFT = "com.microsoft"
# MatMulNBits accuracy levels: 1 computes with float32 activations (the default), 4 quantizes each activation block
# to int8 first (ONNX Runtime GenAI's CPU choice, faster: `--int8-activations`). With level 4 a last-bit difference
# between a token computed alone and among others (ort_kernels: row padding) becomes an int8 rounding difference and
# logit differences of up to ~1.6 on SmolLM2, so such graphs pad their calls to the rows that make every kernel
# row-invariant on the machine that runs them (runtime/row_invariance.py); level 1 keeps any such difference at
# float rounding (~1e-6), like float32 engines.
ACCURACY_FP32 = ef.ACCURACY_FLOAT32
ACCURACY_INT8 = ef.ACCURACY_INT8
# The one decision on the mode's own weights (heads, draft layers) under --weights int4/int8: they stay float, in the
# engine's float dtype (mode_nodes are left out of quantization; engine.yaml says so in weights.mode_weights).
# Quantized, they made int4 speculative engines slower (docs/benchmarks/design-measurements.md).
# What a quantized graph's greedy agreement is measured on (when the checkpoint has a tokenizer).
QUANTIZATION_CHECK_TEXT = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    "The capital of France is Paris. Speculative decoding drafts tokens and verifies them in one pass."
)
PLUGIN_ATTRIBUTE = "plugin"  # the step module's attribute holding the mode's modules (builder/network/step.py)
ONNX_DOMAINS = ("", "ai.onnx")


EXPORT_ROOT = "_export_root."  # the prefix of module paths inside an If branch (the step's drafting, step.draft)


def nodes(model: ir.Model) -> list[ir.Node]:
    """Every node of the model, those of If branches (subgraphs) included."""
    return list(ir.traversal.RecursiveGraphIterator(model.graph))


def name_nodes_uniquely(model: ir.Model) -> None:
    """Give each node a name no other node of the model has (a branch's nodes may repeat the main graph's): the
    quantizer selects nodes by name."""
    seen: set[str] = set()
    for node in nodes(model):
        name, n = node.name or "node", 1
        while name in seen:
            name, n = f"{node.name}_{n}", n + 1
        node.name = name
        seen.add(name)


def _module_path(namespace: str) -> str:
    """The module path of the first module a node's `namespace` metadata names (the exporter records
    `<step>/<path>: <type>/.../<op>: <aten op>` in the main graph, `<path>: <type>/.../<op>: <aten op>` with paths
    under `_export_root.` in an If branch); "" when the node is outside every submodule."""
    for scope in namespace.split("/")[:-1]:  # the last part is the aten op
        path = scope.split(":")[0].strip()
        if path:
            return path.removeprefix(EXPORT_ROOT)
    return ""


def mode_nodes(model: ir.Model) -> set[str]:
    """The nodes of the mode's own modules (heads, draft layers), in the main graph or an If branch: their weights
    stay float (see above). Call name_nodes_uniquely first.

    The exporter records each node's module path in its `namespace` metadata (_module_path); the mode's modules sit
    under the step module's `plugin` attribute (PLUGIN_ATTRIBUTE)."""
    out = set()
    for node in nodes(model):
        if _module_path(node.metadata_props.get("namespace", "")).split(".")[0] == PLUGIN_ATTRIBUTE:
            out.add(node.name)
    return out


class _Blocks:
    """A float weight's quantized parts, computed once when the first is written and let go with the last."""

    def __init__(self, weight: ir.TensorProtocol, quantize: Callable[[np.ndarray], tuple], parts: int):
        self.weight, self.quantize, self.parts = weight, quantize, parts
        self.done: dict[int, object] = {}
        self.cached: tuple | None = None
        self.lock = threading.Lock()  # the graph is written by several threads (ir_weights.save)

    def part(self, index: int, make: Callable) -> Callable[[], ir.TensorProtocol]:
        def read():
            with self.lock:
                if self.cached is None:
                    self.cached = self.quantize(self.weight.numpy())
                value = make(self.cached[index])
                self.done[index] = True
                if len(self.done) == self.parts:  # every part written: free the arrays (a rewrite recomputes them)
                    self.cached, self.done = None, {}
            return value

        return read


def _initializer(graph: ir.Graph, name: str, dtype: ir.DataType, shape, read) -> ir.Value:
    value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))
    value.const_value = ir.LazyTensor(read, dtype=dtype, shape=ir.Shape(shape), name=name)
    graph.register_initializer(value)
    return value


def _weight(node: ir.Node, index: int) -> ir.Value | None:
    """The node's input `index` when it is a float 2-D initializer with its value."""
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None or not value.is_initializer() or value.const_value is None:
        return None
    tensor = value.const_value
    if len(tensor.shape) != 2 or tensor.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return None
    return value


def _replace_node(graph: ir.Graph, old: ir.Node, new: list[ir.Node]) -> None:
    """`new` (whose last node computes old's one output) in old's place, under old's output name, type and shape (a
    graph output keeps them: the ONNX checker refuses an untyped one)."""
    out, result = old.outputs[0], new[-1].outputs[0]
    name = out.name
    graph.insert_before(old, new)
    out.replace_all_uses_with(result, replace_graph_outputs=True)
    graph.remove(old, safe=True)
    result.name = name
    if result.type is None:
        result.type, result.shape = out.type, out.shape


def _drop_unread(graph: ir.Graph, values) -> None:
    for value in values:
        if value.name in graph.initializers and not list(value.uses()) and not value.is_graph_output():
            graph.initializers.pop(value.name)


def _block_quantizer(bits: int, block_size: int, accuracy_level: int, qdq: bool):
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=accuracy_level,
        quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator,
        op_types_to_quantize=("MatMul",),
        bits=bits,
    )
    quantizer = DefaultWeightOnlyQuantizer(config)

    def quantize(weight: np.ndarray) -> tuple:
        packed, scales, _ = quantizer.qbits_block_quant(np.ascontiguousarray(weight))  # its kernels read row-major
        return packed, scales

    return quantize


def quantize_matmuls(model: ir.Model, bits: int, block_size: int, accuracy_level: int, qdq: bool, select) -> int:
    """Every MatMul that select(node) takes, whose B is a 2-D float initializer: B in `bits`-bit blocks, QDQ
    (DequantizeLinear -> MatMul, 4-bit only) or MatMulNBits; a weight read by several MatMuls is quantized once.
    Returns how many matmuls were quantized."""
    graph = model.graph
    quantize = _block_quantizer(bits, block_size, accuracy_level, qdq)
    done: dict[str, tuple[ir.Value, ir.Value]] = {}
    # QDQ: one DequantizeLinear per weight and graph (an If branch reads its own), read by each of its MatMuls there
    dequantized: dict[tuple[str, int], ir.Value] = {}
    sources, count = [], 0
    for node in nodes(model):
        if node.op_type != "MatMul" or node.domain not in ONNX_DOMAINS or not select(node):
            continue
        weight = _weight(node, 1)
        if weight is None:
            continue
        k, n = (int(d) for d in weight.const_value.shape)
        if weight.name not in done:
            done[weight.name] = _quantized_weight(graph, weight, quantize, bits, block_size, qdq)
            sources.append(weight)
        data, scales = done[weight.name]
        if qdq:
            key = (weight.name, id(node.graph))
            if key not in dequantized:
                dq = ir.Node("", "DequantizeLinear", [data, scales], [ir.AttrInt64("axis", 0),
                             ir.AttrInt64("block_size", block_size)], name=f"{node.name}_DQ_Q{bits}")  # fmt: skip
                dq.outputs[0].name = f"{data.name}_output" + ("" if node.graph is graph else f"_{node.name}")
                node.graph.insert_before(node, dq)
                dequantized[key] = dq.outputs[0]
            node.replace_input_with(1, dequantized[key])
        else:
            attributes = [ir.AttrInt64(key, value) for key, value in
                          (("K", k), ("N", n), ("bits", bits), ("block_size", block_size))]  # fmt: skip
            if accuracy_level:
                attributes.append(ir.AttrInt64("accuracy_level", accuracy_level))
            new = ir.Node(MSFT, "MatMulNBits", [node.inputs[0], data, scales], attributes, name=f"{node.name}_Q{bits}")
            _replace_node(node.graph, node, [new])
        count += 1
    _drop_unread(graph, sources)
    if count and not qdq:
        model.opset_imports.setdefault(MSFT, 1)
    return count


def _quantized_weight(graph, weight: ir.Value, quantize, bits: int, block_size: int, qdq: bool):
    """(data, scales) initializers of `weight` [K, N], lazy: made when the graph is written."""
    tensor = weight.const_value
    k, n = (int(d) for d in tensor.shape)
    blocks = (k + block_size - 1) // block_size
    lazy = _Blocks(tensor, quantize, 2)
    scales_type = tensor.dtype
    if qdq:
        data = _initializer(graph, f"{weight.name}_DQ_Q{bits}", ir.DataType.INT4, (k, n), lazy.part(0, _int4((k, n))))
        scales = _initializer(graph, f"{weight.name}_DQ_scales", scales_type, (blocks, n), lazy.part(1, ir.Tensor))
    else:
        blob = (block_size * bits + 7) // 8
        data = _initializer(graph, f"{weight.name}_Q{bits}", ir.DataType.UINT8, (n, blocks, blob),
                            lazy.part(0, ir.Tensor))  # fmt: skip
        scales = _initializer(graph, f"{weight.name}_scales", scales_type, (n, blocks), lazy.part(1, ir.Tensor))
    return data, scales


def _int4(shape: tuple[int, int]) -> Callable[[np.ndarray], ir.TensorProtocol]:
    """Packed INT4 bytes (two values a byte) as a tensor of `shape`."""
    return lambda packed: ir.PackedTensor(packed, ir.DataType.INT4, shape=shape)


def _quantized_table(graph: ir.Graph, table: ir.Value, block_size: int, bits: int) -> tuple[ir.Value, ir.Value]:
    """(INT4 or UINT8 data, float32 scales) initializers of embedding `table` [V, H], blocks along H, lazy."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    v, h = (int(d) for d in table.const_value.shape)
    blocks = (h + block_size - 1) // block_size
    if bits == 8:
        lazy = _Blocks(table.const_value, lambda array: quantize_table_rows_int8(array, block_size), 2)
        data = _initializer(graph, f"{table.name}_uint8", ir.DataType.UINT8, (v, h), lazy.part(0, ir.Tensor))
        scales = _initializer(graph, f"{table.name}_uint8_scales", ir.DataType.FLOAT, (v, blocks),
                              lazy.part(1, ir.Tensor))  # fmt: skip
        return data, scales

    def quantize(array):
        if h % block_size:  # a partial last block: ONNX Runtime's own loop
            return DefaultWeightOnlyQuantizer.quantize_ndarray(np.ascontiguousarray(array), 1, block_size, True)[:2]
        return quantize_table_rows(array, block_size)

    lazy = _Blocks(table.const_value, quantize, 2)
    data = _initializer(graph, f"{table.name}_int4", ir.DataType.INT4, (v, h), lazy.part(0, _int4((v, h))))
    scales = _initializer(graph, f"{table.name}_int4_scales", ir.DataType.FLOAT, (v, blocks),
                          lazy.part(1, lambda s: ir.Tensor(s.astype(np.float32))))  # fmt: skip
    return data, scales


TABLE_ROWS = 4096  # rows of an embedding table quantized at once (bounds the float temporaries)


def quantize_table_rows(table: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed INT4 [V*H/2] uint8, scales [V, H/block]) of `table` [V, H] in symmetric blocks of `block_size` along
    H (a divisor of H): ONNX Runtime's DefaultWeightOnlyQuantizer.quantize_ndarray(table, 1, block_size, True)
    bit for bit (the same float32 operations on each element), its loop over the block columns of the whole table
    (a strided pass per column) turned into one pass over blocks of rows, in torch (faster than numpy's; both
    measured in docs/benchmarks/design-measurements.md)."""
    import torch

    v, h = table.shape
    packed = np.empty(v * h // 2, dtype=np.uint8)
    scales = np.empty((v, h // block_size), dtype=table.dtype)
    for start in range(0, v, TABLE_ROWS):
        rows = torch.from_numpy(np.array(table[start : start + TABLE_ROWS]))  # a copy: the table may be read-only
        rows = rows.reshape(-1, h // block_size, block_size)
        low, high = torch.aminmax(rows, dim=2, keepdim=True)
        scale = torch.where(high.abs() > low.abs(), high, low) / -8.0  # ONNX Runtime's quant_slice_symmetric
        # a block of zeros: 0/0, replaced by 0; round half to even as numpy does
        quantized = torch.where(scale == 0, 0.0, rows / scale).round_().clamp_(-8, 7).to(torch.int8)
        nibbles = (quantized.reshape(-1, 2) & 0xF).to(torch.uint8)
        end = start + rows.shape[0]
        packed[start * h // 2 : end * h // 2] = (nibbles[:, 0] | (nibbles[:, 1] << 4)).numpy()
        scales[start:end] = scale.reshape(-1, h // block_size).numpy()
    return packed, scales


def quantize_table_rows_int8(table: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [V, H] around 128, scales float32 [V, H/block]) of `table` [V, H] in symmetric 8-bit blocks of
    `block_size` along H (GatherBlockQuantized's 8-bit form: value = (data - 128) * scale), TABLE_ROWS at a time."""
    v, h = table.shape
    blocks = -(-h // block_size)
    data = np.empty((v, h), dtype=np.uint8)
    scales = np.empty((v, blocks), dtype=np.float32)
    for start in range(0, v, TABLE_ROWS):
        rows = np.zeros((min(TABLE_ROWS, v - start), blocks * block_size), np.float32)
        rows[:, :h] = table[start : start + TABLE_ROWS]
        rows = rows.reshape(len(rows), blocks, block_size)
        scale = np.abs(rows).max(axis=2, keepdims=True) / np.float32(127)
        scale = np.where(scale > 0, scale, np.float32(1))
        q = np.clip(np.rint(rows / scale), -127, 127) + 128
        data[start : start + len(rows)] = q.reshape(len(rows), -1)[:, :h].astype(np.uint8)
        scales[start : start + len(rows)] = scale[:, :, 0]
    return data, scales


def quantize_embedding(model: ir.Model, block_size: int, fused: bool, bits: int = 4) -> int:
    """Gather(E [V,H] float32 initializer, ids) -> INT4 E (blocks along H, symmetric, ONNX Runtime's numerics) or
    8-bit E (fused only), each table quantized once whatever the number of gathers that read it:
    GatherBlockQuantized (fused, the ONNX Runtime graph) or one DequantizeLinear -> Gather (the portable graph)."""
    graph = model.graph
    done: dict[str, tuple] = {}
    dequantized: dict[tuple[str, int], ir.Value] = {}  # portable: one DequantizeLinear per table and graph
    tables = []
    for node in nodes(model):
        if node.op_type != "Gather" or node.domain not in ONNX_DOMAINS:
            continue
        table = _weight(node, 0)
        axis = node.attributes["axis"].as_int() if "axis" in node.attributes else 0
        if table is None or axis != 0 or table.const_value.dtype != ir.DataType.FLOAT or table.const_value.shape[1] % 2:
            continue
        if table.name not in done:
            done[table.name] = _quantized_table(graph, table, block_size, bits)
            tables.append(table)
        data, scales = done[table.name]
        if fused:
            attributes = [ir.AttrInt64("bits", bits), ir.AttrInt64("block_size", block_size),
                          ir.AttrInt64("gather_axis", 0), ir.AttrInt64("quantize_axis", 1)]  # fmt: skip
            new = ir.Node(MSFT, "GatherBlockQuantized", [data, node.inputs[1], scales], attributes,
                          name=f"{node.name}_quantized")  # fmt: skip
            _replace_node(node.graph, node, [new])
            continue
        key = (table.name, id(node.graph))
        if key not in dequantized:  # one DequantizeLinear for the table (TensorRT folds it into the weights)
            dq = ir.Node("", "DequantizeLinear", [data, scales], [ir.AttrInt64("axis", 1),
                         ir.AttrInt64("block_size", block_size)], name=f"{table.name}_dequantize")  # fmt: skip
            dq.outputs[0].name = f"{table.name}_dequantized" + ("" if node.graph is graph else f"_{node.name}")
            node.graph.insert_before(next(iter(node.graph)), dq)
            dequantized[key] = dq.outputs[0]
        node.replace_input_with(0, dequantized[key])
    _drop_unread(graph, tables)
    if fused and done:
        model.opset_imports.setdefault(MSFT, 1)
    return len(done)


def convert_opset(model: ir.Model, version: int) -> None:
    """Move `model` to opset `version` of the default domain (blockwise DequantizeLinear and INT4 need 21); the
    weights are not read."""
    current = model.opset_imports.get("", version)
    if current >= version:
        return
    from onnxscript.version_converter import convert_version

    try:
        convert_version(model, version)
    except Exception as exc:  # the converter names the op it cannot adapt
        raise SpecbuildError(f"cannot move the graph to opset {version} for blockwise quantization ({exc})") from None


def quantize_base(model: ir.Model, bits: int, block_size: int, accuracy_level: int, fused_gather: bool) -> int:
    """The base network's weights of `model` (not the mode's own, mode_nodes) in `bits`-bit blocks (see the module):
    int4 as QDQ at opset 21 with an INT4 embedding, int8 as MatMulNBits, or integer GEMMs with int8 activations.
    Returns how many matmuls."""
    float_nodes = mode_nodes(model)
    qdq = bits == 4
    if qdq:
        convert_opset(model, QDQ_OPSET)
    try:
        if bits == 8 and accuracy_level == ACCURACY_INT8:  # integer GEMMs (builder/quantize/int8_gemm.py)
            count = integer_matmuls(model, lambda n: n.name not in float_nodes)
            if fused_gather:  # the embedding in 8-bit blocks (GatherBlockQuantized)
                quantize_embedding(model, block_size, fused=True, bits=8)
            return count
        count = quantize_matmuls(model, bits, block_size, accuracy_level, qdq, lambda n: n.name not in float_nodes)
    except (AssertionError, ValueError) as exc:  # the quantizer refuses shapes it cannot handle
        raise SpecbuildError(f"weight quantization failed ({exc})") from None
    if qdq:
        quantize_embedding(model, block_size, fused=fused_gather)
    return count


def quantize_heads(model: ir.Model, names: set[str], bits: int, block_size: int) -> int:
    """`build --head-weights`: the mode's own matmuls among the nodes `names` (mode_nodes) as MatMulNBits with
    `bits`-bit blocks and int8 activations (accuracy level 4; the draft's calls have a few rows, where level 1 would
    dequantize the weights). The heads only propose drafts: their roundings never change an accepted token. Returns
    how many matmuls were quantized (the target's stay as they are)."""
    _gemms_to_matmuls(model, names)
    count = quantize_matmuls(model, bits, block_size, ACCURACY_INT8, False, lambda n: n.name in names)
    _drop_unread(model.graph, list(model.graph.initializers.values()))  # the float weights the quantized replaced
    return count


def _gemms_to_matmuls(model: ir.Model, readers: set[str]) -> None:
    """Gemm(A, constant B) among `readers` (alpha 1, A not transposed) -> MatMul(A, B or its transposed copy) and
    Add(C) where it has one, under the Gemm's name (the quantizer takes MatMul only). A weight the target also reads
    (Medusa's heads share the base lm_head) gets a copy of its own; the target keeps the float one."""
    graph = model.graph
    transposed: dict[str, ir.Value] = {}
    for node in nodes(model):
        attrs = {k: a.value for k, a in node.attributes.items()}
        weight = _weight(node, 1) if node.op_type == "Gemm" else None
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if (
            weight is None
            or node.name not in readers
            or attrs.get("alpha", 1.0) != 1.0
            or attrs.get("transA", 0)
            or (bias is not None and attrs.get("beta", 1.0) != 1.0)
        ):
            continue
        if attrs.get("transB", 0):
            if weight.name not in transposed:
                transposed[weight.name] = _transposed(graph, weight)
            weight = transposed[weight.name]
        matmul = ir.Node("", "MatMul", [node.inputs[0], weight], name=node.name)
        matmul.outputs[0].name = f"{node.name}.matmul"  # named: an unnamed value of an If branch may take an outer name
        new = [matmul]
        if bias is not None:
            new.append(ir.Node("", "Add", [matmul.outputs[0], bias], name=f"{node.name}.bias"))
        _replace_node(node.graph, node, new)


def _transposed(graph: ir.Graph, weight: ir.Value) -> ir.Value:
    """A lazy initializer holding weight^T (a copy: others may read the weight as it is)."""
    tensor = weight.const_value
    n, k = (int(d) for d in tensor.shape)

    def read():
        return ir.Tensor(np.ascontiguousarray(tensor.numpy().T))

    return _initializer(graph, f"{weight.name}.transposed", tensor.dtype, (k, n), read)


def quantize_step_graph(step, onnx_path: Path, plan, name: str, log) -> dict:
    """Compare the quantized graph at onnx_path with the float torch step over a sample text, drop the logits output
    the comparison needed (unless asked for); return engine.yaml's graphs[].quantization."""
    from specbuild.builder.export.exporter import compare_quantized, drop_output

    bits, block_size = plan.quantized_bits, plan.options.weights_block_size
    level = ACCURACY_INT8 if plan.options.int8_activations else ACCURACY_FP32
    integer = bits == 8 and level == ACCURACY_INT8  # builder/quantize/int8_gemm.py
    q = {
        "bits": bits,
        "block_size": None if integer else block_size,
        "symmetric": True,
        "accuracy_level": level,
        "kernel": "MatMulIntegerToFloat (activations per row, weights per column)" if integer else "MatMulNBits",
        **compare_quantized(step, onnx_path, sample_prompt(plan.checkpoint), accuracy_level=level),
    }
    log(
        f"{plan.weights} {name} graph against torch: top-1 agreement {q['top1_agreement']:.1%} over "
        f"{q['positions']} positions, logit error max {q['max_logit_error']:.3f} mean {q['mean_logit_error']:.4f} "
        "(relative)"
    )
    if not plan.options.output_logits:
        drop_output(onnx_path, ef.LOGITS)
    return q


def sample_prompt(ckpt, length: int = 48) -> list[int]:
    """Token ids to check a quantized graph on: real text when the checkpoint has a tokenizer, else a fixed draw."""
    vocab = ckpt.model.vocab_size
    if ckpt.tokenizer_file is not None:
        from specbuild.runtime.text import TextCodec

        ids = TextCodec(ckpt.tokenizer_file).encode(QUANTIZATION_CHECK_TEXT)[:length]
        if len(ids) >= 8 and max(ids) < vocab:
            return ids
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, size=min(length, 32)).tolist()


def _quantized_columns(graph: ir.Graph, weight: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(Wq, w_scale) initializers of `weight` [K, N], lazy: made when the graph is written."""
    k, n = (int(d) for d in weight.const_value.shape)
    lazy = _Blocks(weight.const_value, int8_gemm.quantize_columns, 2)
    return (
        _initializer(graph, f"{weight.name}_int8", ir.DataType.INT8, (k, n), lazy.part(0, ir.Tensor)),
        _initializer(graph, f"{weight.name}_int8_scales", ir.DataType.FLOAT, (n,), lazy.part(1, ir.Tensor)),
    )


def integer_matmuls(model: ir.Model, select) -> int:
    """Every MatMul that select(node) takes, whose B is a 2-D float32 initializer, as builder/quantize/int8_gemm.py's
    integer GEMM (a weight read by several MatMuls is quantized once), the graph first moved to the opset of its
    QuantizeLinear. Returns how many matmuls."""
    chosen = []
    for node in nodes(model):
        if node.op_type != "MatMul" or node.domain not in ONNX_DOMAINS or not select(node):
            continue
        weight = _weight(node, 1)
        if weight is not None and weight.const_value.dtype == ir.DataType.FLOAT:
            chosen.append((node, weight))
    if not chosen:
        return 0
    convert_opset(model, int8_gemm.QUANTIZE_OPSET)
    done: dict[str, tuple[ir.Value, ir.Value]] = {}
    sources, zero_points = [], {}
    for node, weight in chosen:
        if weight.name not in done:
            done[weight.name] = _quantized_columns(model.graph, weight)
            sources.append(weight)
        _replace_node(node.graph, node, int8_gemm.gemm_nodes(model, node, done[weight.name], zero_points))
    _drop_unread(model.graph, sources)
    model.opset_imports.setdefault(int8_gemm.MSFT, 1)
    return len(chosen)
