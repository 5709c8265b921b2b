"""The kernel library's arithmetic in numpy, and the graphs and sessions the kernel tests run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

BLOCK = 32


def on_isa(code: str, isa: str):
    """What `code` prints as JSON on its last line, run in a process whose kernels take the instruction set `isa`
    (fixed when the library loads: SPECBUILD_KERNELS_ISA)."""
    env = {**os.environ, "SPECBUILD_KERNELS_ISA": isa}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def int4_initializer(name: str, q: np.ndarray):
    """A signed int4 [K, N] initializer (values in [-8, 7]), packed two to a byte, the first in the low nibble."""
    flat = (q.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    packed = flat[0::2] | (flat[1::2] << 4)
    return helper.make_tensor(name, TensorProto.INT4, q.shape, packed.tobytes(), raw=True)


def matmul_model(q: np.ndarray, scales: np.ndarray, kernel: bool, rows: tuple = ("m",), int8_activations: int = 1):
    """MatMul(x, DequantizeLinear(q, scales, axis 0, blocks of 32)) as the engines hold it, or one BlockInt4MatMul
    (with int8 or float activations)."""
    k, n = q.shape
    if kernel:
        nodes = [helper.make_node("BlockInt4MatMul", ["x", "w", "s"], ["y"], domain="specbuild.kernels", block_size=32,
                                  int8_activations=int8_activations)]  # fmt: skip
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("specbuild.kernels", 1)]
    else:
        nodes = [
            helper.make_node("DequantizeLinear", ["w", "s"], ["wd"], axis=0, block_size=BLOCK),
            helper.make_node("MatMul", ["x", "wd"], ["y"]),
        ]
        opsets = [helper.make_opsetid("", 21)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, n])],
        [int4_initializer("w", q), numpy_helper.from_array(scales, "s")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The kernel's result: each row's int8 quantization per block (scale amax / 127 in float32, round half to even),
    exact integer dots per block, then acc = fma(float(isum - 8 * asum), sa * sw, acc) over the blocks in order (a
    float64 product and sum rounded once to float32 is a correctly rounded fma)."""
    m, k = x.shape
    n = q.shape[1]
    blocks = x.reshape(m, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    qa = np.clip(np.rint((blocks * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int64)
    sa = (amax / np.float32(127)).astype(np.float32)
    qw = q.astype(np.int64).reshape(k // BLOCK, BLOCK, n)
    acc = np.zeros((m, n), dtype=np.float32)
    for b in range(k // BLOCK):
        isum = qa[:, b] @ qw[b]  # exact: q * 8 offset folded in (sum (q + 8) a - 8 sum a = sum q a)
        f = (sa[:, b][:, None] * scales[b][None, :]).astype(np.float32)
        acc = (acc.astype(np.float64) + isum.astype(np.float64) * f.astype(np.float64)).astype(np.float32)
    return acc


def reference_float(x: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The kernel's result with float activations: per block, p = fma(x[k], q[k], p) over its 32 k in order from 0,
    then acc = fma(p, sw, acc) over the blocks in order (each fma: the float64 product, exact here, and sum rounded
    once to float32)."""
    m, k = x.shape
    n = q.shape[1]
    x64, q64, s64 = x.astype(np.float64), q.astype(np.float64), scales.astype(np.float64)
    acc = np.zeros((m, n), dtype=np.float32)
    for b in range(k // BLOCK):
        p = np.zeros((m, n), dtype=np.float32)
        for t in range(b * BLOCK, (b + 1) * BLOCK):
            p = (x64[:, t : t + 1] * q64[t][None, :] + p.astype(np.float64)).astype(np.float32)
        acc = (p.astype(np.float64) * s64[b][None, :] + acc.astype(np.float64)).astype(np.float32)
    return acc


# ---------------------------------------------------------------------------------------------- OrderedAttention
ATTENTION_SLOTS = {0: "qkv", 3: "past_k", 4: "past_v", 5: "seqlens_k", 6: "total", 7: "cos", 8: "sin",
                   9: "position_ids", 10: "bias", 12: "k_scale", 13: "v_scale", 16: "query_lens"}  # fmt: skip


def attention_model(heads: int, kv_heads: int, dim: int, kernel: bool, int8: bool = False, window: int = -1,
                    softcap: float = 0.0, scale: float = 0.0, positions: bool = False, bias: bool = False):  # fmt: skip
    """One attention node as the engines hold it -- com.microsoft GroupQueryAttention (packed QKV, rotary, the cache
    buffers, query_seqlens), optional position_ids / attention_bias, an int8 cache -- or, with `kernel`, the
    OrderedAttention node the rewrite puts in its place. Its feeds: attention_feeds."""
    used = {0, 3, 4, 5, 6, 7, 8, 16} | ({9} if positions else set()) | ({10} if bias else set())
    used |= {12, 13} if int8 else set()
    names = [ATTENTION_SLOTS[i] if i in used else "" for i in range(17)]
    cache = TensorProto.INT8 if int8 else TensorProto.FLOAT
    if kernel:
        attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=scale, softcap=softcap, local_window_size=window)
        node = helper.make_node("OrderedAttentionInt8" if int8 else "OrderedAttention", names, ["out", "k", "v"],
                                domain="specbuild.kernels", **attrs)  # fmt: skip
    else:
        attrs = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, local_window_size=window)
        attrs |= {"scale": scale} if scale else {}
        attrs |= {"softcap": softcap} if softcap else {}
        attrs |= dict(kv_cache_bit_width=8, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR") if int8 else {}
        node = helper.make_node("GroupQueryAttention", names, ["out", "k", "v"], domain="com.microsoft", **attrs)
    width = (heads + 2 * kv_heads) * dim
    infos = {
        "qkv": (TensorProto.FLOAT, ["b", "t", width]), "past_k": (cache, ["b", kv_heads, "c", dim]),
        "past_v": (cache, ["b", kv_heads, "c", dim]), "seqlens_k": (TensorProto.INT32, ["b"]),
        "total": (TensorProto.INT32, []), "cos": (TensorProto.FLOAT, ["p", "h"]),
        "sin": (TensorProto.FLOAT, ["p", "h"]), "position_ids": (TensorProto.INT64, ["b", "t"]),
        "bias": (TensorProto.FLOAT, ["bb", 1, "t", "c"]), "k_scale": (TensorProto.FLOAT, [1]),
        "v_scale": (TensorProto.FLOAT, [1]), "query_lens": (TensorProto.INT32, ["b"]),
    }  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, *infos[n]) for n in names if n]
    outputs = [
        helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "t", heads * dim]),
        helper.make_tensor_value_info("k", cache, ["b", kv_heads, "c", dim]),
        helper.make_tensor_value_info("v", cache, ["b", kv_heads, "c", dim]),
    ]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    opsets += [helper.make_opsetid("specbuild.kernels", 1)] if kernel else []
    return helper.make_model(helper.make_graph([node], "g", inputs, outputs), opset_imports=opsets, ir_version=10)


def attention_feeds(qkv, past_k, past_v, past, cos, sin, position_ids=None, bias=None, k_scale=None, v_scale=None):
    """The named feeds of attention_model for new rows qkv [B, T, W] after `past` [B] cached tokens."""
    b, t, _ = qkv.shape
    feeds = {
        "qkv": qkv, "past_k": past_k, "past_v": past_v, "seqlens_k": (np.asarray(past) + t - 1).astype(np.int32),
        "total": np.array(past_k.shape[2], np.int32), "cos": cos, "sin": sin,
        "query_lens": np.full((b,), t, np.int32),
    }  # fmt: skip
    if position_ids is not None:
        feeds["position_ids"] = position_ids.astype(np.int64)
    if bias is not None:
        feeds["bias"] = bias.astype(np.float32)
    if k_scale is not None:
        feeds["k_scale"] = np.array([k_scale], np.float32)
        feeds["v_scale"] = np.array([v_scale], np.float32)
    return feeds


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half rotary of x [..., D] in float32 with cos/sin [..., R/2] (the first R dims; the kernel's
    arithmetic: each product rounded, then the sum)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]], axis=-1).astype(np.float32)


def attention_reference(feeds: dict, heads: int, kv_heads: int, window: int = -1, softcap: float = 0.0,
                        scale: float = 0.0):  # fmt: skip
    """(out [B, T, Hq D] in float64, present_k, present_v): the present buffers bit for bit as the kernel writes
    them (rotated keys, an int8 cache quantized round half to even, saturating), the attention in float64 over the
    columns each row sees (the bias's finite entries, else the causal chain and its window)."""
    qkv, past_k, past_v = feeds["qkv"], feeds["past_k"], feeds["past_v"]
    cos, sin, bias = feeds["cos"], feeds["sin"], feeds.get("bias")
    b, t, _ = qkv.shape
    d = past_k.shape[3]
    past = feeds["seqlens_k"].astype(np.int64) + 1 - t
    ids = feeds.get("position_ids", past[:, None] + np.arange(t)[None, :])
    int8 = past_k.dtype == np.int8
    ks, vs = (float(feeds["k_scale"][0]), float(feeds["v_scale"][0])) if int8 else (1.0, 1.0)
    q = qkv[..., : heads * d].reshape(b, t, heads, d)
    k = qkv[..., heads * d : (heads + kv_heads) * d].reshape(b, t, kv_heads, d)
    v = qkv[..., (heads + kv_heads) * d :].reshape(b, t, kv_heads, d)
    q = rotate(q, cos[ids][:, :, None], sin[ids][:, :, None])
    k = rotate(k, cos[ids][:, :, None], sin[ids][:, :, None])
    present_k, present_v = past_k.copy(), past_v.copy()
    for row in range(b):
        for i in range(t):
            for new, buffer, s in ((k, present_k, ks), (v, present_v, vs)):
                value = new[row, i]
                if int8:
                    value = np.clip(np.rint(value / np.float32(s)), -128, 127).astype(np.int8)
                buffer[row, :, past[row] + i] = value
    scale = scale or 1.0 / np.sqrt(d)
    out = np.zeros((b, t, heads, d))
    for row in range(b):
        for i in range(t):
            last = past[row] + i
            if bias is not None:
                line = bias[0 if bias.shape[0] == 1 else row, 0, i, : past[row] + t].astype(np.float64)
            else:
                line = np.full(past[row] + t, -np.inf)
                line[max(0, last - window + 1) if window > 0 else 0 : last + 1] = 0.0
            seen = np.isfinite(line)
            for h in range(heads):
                g = h // (heads // kv_heads)
                keys = present_k[row, g, : past[row] + t].astype(np.float64) * ks
                values = present_v[row, g, : past[row] + t].astype(np.float64) * vs
                s = keys @ q[row, i, h].astype(np.float64) * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                s = np.where(seen, s + np.where(seen, line, 0.0), -np.inf)
                p = np.exp(s - s.max())
                out[row, i, h] = (p / p.sum()) @ values
    return out.reshape(b, t, heads * d), present_k, present_v
