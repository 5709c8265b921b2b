"""Weight-only quantization of exported step graphs (`build --weights int4|int8`), with ONNX Runtime's own tool.

int4 (symmetric, blocks of `block_size` along K): every MatMul with a constant weight becomes DequantizeLinear
(INT4 + per-block scales, opset 21) -> MatMul, made by onnxruntime.quantization's MatMulNBitsQuantizer in QDQ form.
That one form serves both graphs: TensorRT's parser takes blockwise INT4 DequantizeLinear with a zero zero-point,
and ONNX Runtime fuses the pair into its MatMulNBits kernel when it loads the graph (at the accuracy level the
engine records, see below). The same weight gives the same bytes in both graphs, so the engine stores them once
(see weights_file). The embedding gather is quantized the same way (INT4 [V,H], blocks along H): GatherBlockQuantized
in the ONNX Runtime graph, DequantizeLinear -> Gather in the portable one, from the same bytes.

int8: MatMulNBits with 8-bit blocks in the ONNX Runtime graph only (QDQ INT8 blocks are not in TensorRT's parser
matrix and the quantizer's QDQ form is 4-bit only): `--weights int8` builds the onnxruntime graph alone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specbuild import engine_format as ef
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
# Quantized, they made int4 speculative engines 1.7-2x slower on the CPU measured (docs/benchmarks/).
# What a quantized graph's greedy agreement is measured on (when the checkpoint has a tokenizer).
QUANTIZATION_CHECK_TEXT = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    "The capital of France is Paris. Speculative decoding drafts tokens and verifies them in one pass."
)
PLUGIN_ATTRIBUTE = "plugin"  # the step module's attribute holding the mode's modules (builder/step.py)


def mode_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes of the mode's own modules (heads, draft layers): their weights stay float (see above).

    The exporter records each node's module path in its `namespace` metadata, `<step>/<attribute>.<...>: <type>/...`;
    the mode's modules sit under the step module's `plugin` attribute (PLUGIN_ATTRIBUTE)."""
    out = []
    for node in model.graph.node:
        scope = next((p.value for p in node.metadata_props if p.key == "namespace"), "").split("/")
        if len(scope) > 1 and scope[1].split(":")[0].split(".")[0] == PLUGIN_ATTRIBUTE:
            out.append(node.name)
    return out


def quantize_graph(onnx_path: Path, bits: int, block_size: int, fused_gather: bool, accuracy_level: int) -> None:
    """Quantize the graph at `onnx_path` in place (`_replace_graph`): the base network's weights; the mode's own
    matmuls (mode_nodes) stay float.

    fused_gather: the embedding becomes GatherBlockQuantized (ONNX Runtime graph) instead of DequantizeLinear ->
    Gather (portable graph)."""
    model = onnx.load(str(onnx_path))
    float_nodes = mode_nodes(model)  # before the opset conversion, which drops the nodes' metadata
    if bits == 4:
        model = _with_opset(model, QDQ_OPSET)
    try:
        model = _quantize_matmuls(model, bits, block_size, accuracy_level, qdq=bits == 4, exclude=float_nodes)
    except Exception as exc:  # the quantizer raises assertion/value errors on shapes it cannot handle
        raise SpecbuildError(f"{onnx_path.name}: weight quantization failed ({exc})") from None
    if bits == 4:
        _quantize_embedding(model, block_size, fused=fused_gather)
    _replace_graph(onnx_path, model, "quantized")


def _replace_graph(onnx_path: Path, model: onnx.ModelProto, stage: str) -> None:
    """Write `model` over the graph at onnx_path: saved beside it first (`stage`.NAME, with a data file of its own,
    kept until share_weights gathers every graph's tensors), then swapped in; data files nothing reads any more go."""
    staged = onnx_path.with_name(f"{stage}.{onnx_path.name}")
    onnx.save(model, str(staged), save_as_external_data=True, location=staged.name + ".data", size_threshold=1024)
    before = _external_files(onnx_path)
    staged.replace(onnx_path)
    for name in before - _external_files(onnx_path):
        (onnx_path.parent / name).unlink(missing_ok=True)


def _quantize_matmuls(model, bits: int, block_size: int, accuracy_level: int, qdq: bool, exclude: list[str]):
    """onnxruntime.quantization's MatMulNBitsQuantizer over every constant-weight MatMul but `exclude`: symmetric
    blocks, QDQ (DequantizeLinear -> MatMul, 4-bit only) or MatMulNBits; each repeated definition kept once."""
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    settings = dict(
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=accuracy_level,
        quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator,
        op_types_to_quantize=("MatMul",),
    )
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    config = DefaultWeightOnlyQuantConfig(bits=bits, **settings)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, algo_config=config, nodes_to_exclude=exclude, **settings)
    quantizer.process()
    model = quantizer.model.model
    _merge_repeated_definitions(model)
    return model


def quantize_mode_weights(onnx_path: Path, names: list[str], bits: int, block_size: int) -> int:
    """`build --head-weights`: the mode's own matmuls among the nodes `names` (mode_nodes, read from the graph as
    exported: quantization drops the metadata) of the ONNX Runtime graph at onnx_path, in place, as MatMulNBits with
    `bits`-bit blocks and int8 activations (accuracy level 4; the draft's calls have a few rows, where level 1 would
    dequantize the weights). The heads only propose drafts: their roundings never change an accepted token. Returns
    how many matmuls were quantized (the target's stay as they are)."""
    model = onnx.load(str(onnx_path))
    wanted = set(names)
    _gemms_to_matmuls(model, wanted)
    _fold_weight_transposes(model, wanted)
    inits = {i.name for i in model.graph.initializer}
    heads = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name in wanted and n.input[1] in inits]
    if not heads:
        return 0
    others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in set(heads)]
    try:
        model = _quantize_matmuls(model, bits, block_size, ACCURACY_INT8, qdq=False, exclude=others)
    except Exception as exc:  # the quantizer raises assertion/value errors on shapes it cannot handle
        raise SpecbuildError(f"{onnx_path.name}: head weight quantization failed ({exc})") from None
    used = _read_names(model.graph)
    for init in list(model.graph.initializer):  # the float weights the quantized ones replaced
        if init.name not in used:
            model.graph.initializer.remove(init)
    _replace_graph(onnx_path, model, "heads")
    return len(heads)


def _external_files(onnx_path: Path) -> set[str]:
    model = onnx.load(str(onnx_path), load_external_data=False)
    return {e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"}


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node of `graph` or of its subgraphs (If branches) reads, and the graph's outputs."""
    names = {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                names |= _read_names(sub)
    return names


def _gemms_to_matmuls(model: onnx.ModelProto, readers: set[str]) -> None:
    """Gemm(A, constant B) among `readers` (alpha 1, A not transposed) -> MatMul(A, B or its transposed copy) and
    Add(C) where it has one, under the Gemm's name (the quantizer takes MatMul only). A weight the target also reads
    (Medusa's heads share the base lm_head) gets a copy of its own; the target keeps the float one."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    transposed: dict[str, str] = {}
    for node in list(graph.node):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type != "Gemm"
            or node.name not in readers
            or node.input[1] not in inits
            or attrs.get("alpha", 1.0) != 1.0
            or attrs.get("transA", 0)
            or (len(node.input) > 2 and node.input[2] and attrs.get("beta", 1.0) != 1.0)
        ):
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):
            if weight not in transposed:
                transposed[weight] = f"{weight}.transposed"
                array = numpy_helper.to_array(inits[weight]).T
                graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), transposed[weight]))
            weight = transposed[weight]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        product = f"{node.output[0]}.matmul" if bias else node.output[0]
        replacement = [helper.make_node("MatMul", [node.input[0], weight], [product], name=node.name)]
        if bias:
            replacement.append(helper.make_node("Add", [product, bias], list(node.output), name=f"{node.name}.bias"))
        position = list(graph.node).index(node)
        graph.node.remove(node)
        for offset, new in enumerate(replacement):
            graph.node.insert(position + offset, new)


def _fold_weight_transposes(model: onnx.ModelProto, readers: set[str]) -> None:
    """Transpose(constant) feeding only matmuls among `readers` -> the transposed constant (the quantizer takes
    constant weights only; ONNX Runtime folds such a Transpose at load anyway)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    sources = set()
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.input[0] not in inits:
            continue
        users = consumers.get(node.output[0], [])
        if not users or any(
            u.op_type != "MatMul" or u.name not in readers or u.input[0] == node.output[0] for u in users
        ):
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        folded = numpy_helper.to_array(inits[node.input[0]]).transpose(perm)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(folded), node.output[0]))
        graph.node.remove(node)
        sources.add(node.input[0])
    used = _read_names(graph)
    for name in sources - used:
        graph.initializer.remove(inits[name])


def _merge_repeated_definitions(model: onnx.ModelProto) -> None:
    """A weight read by several MatMuls (a draft lm_head applied at every depth) comes out of the quantizer once per
    reader, under the same names: keep one definition of each (they are identical: same weight, same bytes)."""
    graph = model.graph
    seen: dict[str, onnx.TensorProto] = {}
    for init in list(graph.initializer):
        if init.name in seen:
            if init.SerializeToString() != seen[init.name].SerializeToString():
                raise SpecbuildError(f"weight quantization produced two different tensors named {init.name!r}")
            graph.initializer.remove(init)
        else:
            seen[init.name] = init
    produced: dict[str, onnx.NodeProto] = {}
    for node in list(graph.node):
        first = next((produced[o] for o in node.output if o and o in produced), None)  # "": an unused output
        if first is None:
            produced.update({o: node for o in node.output if o})
        elif (first.op_type, list(first.input), list(first.attribute)) == (
            node.op_type,
            list(node.input),
            list(node.attribute),
        ):
            graph.node.remove(node)
        else:
            raise SpecbuildError(f"weight quantization produced two different nodes writing {node.output[0]!r}")


def _with_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), version)
    if current >= version:
        return model
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, version)
    except Exception as exc:  # the converter names the op it cannot adapt
        raise SpecbuildError(f"cannot move the graph to opset {version} for blockwise quantization ({exc})") from None


def _quantize_embedding(model: onnx.ModelProto, block_size: int, fused: bool) -> None:
    """Gather(E [V,H] constant, ids) -> INT4 E (blocks along H, symmetric, ONNX Runtime's numerics), each table
    quantized once whatever the number of gathers that read it."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    done: dict[str, tuple[str, str, str | None]] = {}  # table -> (INT4 data, scales, dequantized output)
    for node in list(graph.node):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or node.input[0] not in inits:
            continue
        base = node.input[0]
        if base not in done:
            table = numpy_helper.to_array(inits[base])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if table.ndim != 2 or axis != 0 or table.dtype != np.float32 or table.shape[1] % 2:
                continue
            data, scales, _ = DefaultWeightOnlyQuantizer.quantize_ndarray(table, 1, block_size, True)
            qdata = helper.make_tensor(f"{base}_int4", TensorProto.INT4, table.shape, data.tobytes(), raw=True)
            qscales = numpy_helper.from_array(scales.astype(np.float32), f"{base}_int4_scales")
            graph.initializer.extend([qdata, qscales])
            dequantized = None
            if not fused:  # one DequantizeLinear for the table (TensorRT folds it into the weights)
                dequantized = f"{base}_dequantized"
                dq = helper.make_node(
                    "DequantizeLinear",
                    [qdata.name, qscales.name],
                    [dequantized],
                    name=f"{base}_dequantize",
                    axis=1,
                    block_size=block_size,
                )
                graph.node.insert(0, dq)
            done[base] = (qdata.name, qscales.name, dequantized)
        qdata_name, scales_name, dequantized = done[base]
        if fused:
            replacement = helper.make_node(
                "GatherBlockQuantized",
                [qdata_name, node.input[1], scales_name],
                list(node.output),
                name=f"{node.name}_quantized",
                domain=MSFT,
                bits=4,
                block_size=block_size,
                gather_axis=0,
                quantize_axis=1,
            )
        else:
            replacement = helper.make_node("Gather", [dequantized, node.input[1]], list(node.output), name=node.name)
        position = list(graph.node).index(node)
        graph.node.remove(node)
        graph.node.insert(position, replacement)
    for base in done:
        if not any(base in n.input for n in graph.node):
            graph.initializer.remove(inits[base])
    if fused and done and not any(o.domain == MSFT for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MSFT, 1))


def quantize_step_graph(step, onnx_path: Path, plan, fused_gather: bool, name: str, log) -> dict:
    """Quantize the exported graph at onnx_path in place (plan.weights), compare it with the float torch step over a
    sample text, drop the logits output the comparison needed (unless asked for); return engine.yaml's
    graphs[].quantization."""
    from specbuild.builder.export import compare_quantized, drop_output

    bits, block_size = plan.quantized_bits, plan.options.weights_block_size
    level = ACCURACY_INT8 if plan.options.int8_activations else ACCURACY_FP32
    log(f"quantizing the {name} graph's weights to {plan.weights} (blocks of {block_size})")
    quantize_graph(onnx_path, bits, block_size, fused_gather=fused_gather, accuracy_level=level)
    q = {
        "bits": bits,
        "block_size": block_size,
        "symmetric": True,
        "accuracy_level": level,
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
