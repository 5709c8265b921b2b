"""An engine graph made to run on the kernel library, in the graph and in every If/Loop body:

- matmuls: each matmul with 4-bit block weights -- a DequantizeLinear of a constant signed int4 [K, N] initializer
  (K a multiple of 32), axis 0, blocks of 32, no zero point, feeding a MatMul as its weights -- becomes one
  BlockInt4MatMul node on the same initializers, with int8 activations (graphs with int8 activations) or float ones
  (graphs with float activations: their int4 matmuls then give a row the same bits in calls of any size);
- attention (graphs with int8 activations or an int8 KV cache): each com.microsoft GroupQueryAttention node of the
  kind the builder emits (packed QKV, rotate-half rotary, a float cache or an int8 one with a scale per tensor) becomes
  an OrderedAttention / OrderedAttentionInt8 node on the same inputs and outputs, its attributes made explicit.

Nothing else changes: the weights file is read as it is."""

from __future__ import annotations

from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, helper

DOMAIN = "specbuild.kernels"
OP = "BlockInt4MatMul"
INT8, FLOAT = "int8", "float"  # the activations of a graph's int4 matmuls
BLOCK = 32
GQA = ("com.microsoft", "GroupQueryAttention")
ATTENTION_INPUTS = 17  # GroupQueryAttention's input positions, kept by OrderedAttention
# inputs OrderedAttention reads: packed QKV, past K/V, seqlens_k, total length, cos/sin, position_ids, attention_bias,
# the int8 cache's k/v scales, query_seqlens (1/2: separate K/V; 11: head_sink; 14/15: cache tables)
ATTENTION_READS = {0, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16}


def _attr(node, name, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _body_inputs(graph: GraphProto) -> set[str]:
    """Every name the nodes of `graph`'s If/Loop bodies read (outer names among them), at any depth."""
    names = set()
    for node in graph.node:
        for attribute in node.attribute:
            for body in [attribute.g] if attribute.type == AttributeProto.GRAPH else list(attribute.graphs):
                names |= {name for inner in body.node for name in inner.input} | _body_inputs(body)
    return names


def _ordered_attention(node) -> bool:
    """Turn GroupQueryAttention `node` into OrderedAttention[Int8] in place where it is a kind the kernel computes."""
    used = {i for i, name in enumerate(node.input) if name}
    bits = _attr(node, "kv_cache_bit_width", 0)
    quant = (_attr(node, "k_quant_type", b"NONE"), _attr(node, "v_quant_type", b"NONE"))
    int8 = bits == 8 and quant == (b"PER_TENSOR", b"PER_TENSOR") and {12, 13} <= used
    if (
        (node.domain, node.op_type) != GQA
        or len(node.input) > ATTENTION_INPUTS
        or not used <= ATTENTION_READS
        or not {0, 3, 4, 5, 6, 7, 8} <= used
        or len([o for o in node.output if o]) > 3
        or _attr(node, "do_rotary", 0) != 1
        or _attr(node, "rotary_interleaved", 0) != 0
        or _attr(node, "smooth_softmax", 0) != 0
        or _attr(node, "qk_output", 0) != 0
        or (bits not in (0, 8) or (bits == 8 and not int8))
    ):
        return False
    attrs = dict(
        num_heads=_attr(node, "num_heads"),
        kv_num_heads=_attr(node, "kv_num_heads"),
        scale=float(_attr(node, "scale", 0.0)),  # 0: 1 / sqrt(head size)
        softcap=float(_attr(node, "softcap", 0.0)),
        local_window_size=int(_attr(node, "local_window_size", -1)),
    )
    inputs = list(node.input) + [""] * (ATTENTION_INPUTS - len(node.input))
    op = "OrderedAttentionInt8" if int8 else "OrderedAttention"
    fused = helper.make_node(op, inputs, list(node.output), name=node.name, domain=DOMAIN, **attrs)
    fused.metadata_props.extend(node.metadata_props)
    node.CopyFrom(fused)
    return True


def _rewrite(graph: GraphProto, int4: set[str], floats: set[str], matmuls: str | None, attention: bool) -> int:
    """Rewrite `graph` (and its bodies) in place; `int4`/`floats`: the int4 and float initializers visible in it;
    matmuls ("int8" / "float" activations, None: leave them) and attention: which kinds of node to take."""
    # the kernel's blocks are whole: a K of another length (a tied embedding's) stays on ONNX Runtime's kernel
    int4 = int4 | {
        t.name
        for t in graph.initializer
        if t.data_type == TensorProto.INT4 and len(t.dims) == 2 and t.dims[0] % BLOCK == 0
    }
    floats = floats | {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output} | _body_inputs(graph)  # values read elsewhere stay as they are
    rewritten, dropped = 0, set()
    for node in graph.node:
        if attention and _ordered_attention(node):
            rewritten += 1
            continue
        if (
            not matmuls
            or node.op_type != "DequantizeLinear"
            or node.domain not in ("", "ai.onnx")
            or len(node.input) != 2
        ):
            continue
        weight, scale = node.input
        if (
            weight not in int4
            or scale not in floats
            or _attr(node, "axis", 1) != 0
            or _attr(node, "block_size") != BLOCK
        ):
            continue
        users = consumers.get(node.output[0], [])
        if (
            node.output[0] in outputs
            or len(users) != 1
            or users[0].op_type != "MatMul"
            or users[0].domain not in ("", "ai.onnx")
        ):
            continue
        matmul = users[0]
        if list(matmul.input).index(node.output[0]) != 1:
            continue
        fused = helper.make_node(OP, [matmul.input[0], weight, scale], list(matmul.output), name=matmul.name,
                                 domain=DOMAIN, block_size=BLOCK, int8_activations=int(matmuls == INT8))  # fmt: skip
        fused.metadata_props.extend(matmul.metadata_props)
        matmul.CopyFrom(fused)
        dropped.add(id(node))
        rewritten += 1
    if dropped:
        kept = [n for n in graph.node if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(kept)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == AttributeProto.GRAPH:
                rewritten += _rewrite(attribute.g, int4, floats, matmuls, attention)
            elif attribute.type == AttributeProto.GRAPHS:
                rewritten += sum(_rewrite(g, int4, floats, matmuls, attention) for g in attribute.graphs)
    return rewritten


def use_kernels(model: ModelProto, matmuls: str | None = INT8, attention: bool = True) -> int:
    """Rewrite `model` in place for the kernel library; how many nodes now run on it (0: the model is unchanged).
    matmuls: the int4 matmuls, with "int8" activations (the kernel quantizes its input per block, as MatMulNBits level 4
    does) or "float" ones (None: left as they are); attention: the attention."""
    if matmuls not in (INT8, FLOAT, None):
        raise ValueError(f"matmuls must be {INT8!r}, {FLOAT!r} or None, got {matmuls!r}")
    count = _rewrite(model.graph, set(), set(), matmuls, attention)
    if count and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return count
