"""`--kv-cache int8`: the ONNX Runtime graph keeps its KV cache in 8 bits.

At 16 sequences in flight most of a CPU call is attention reading the cache (docs/benchmarks: 66 % of an int4 call
of 16 rows on SmolLM2); ONNX Runtime's GroupQueryAttention reads an int8 cache with a scale per tensor
(`kv_cache_bit_width` 8, `k_scale`/`v_scale` inputs), a quarter of the bytes. It quantizes each new token's key
(after RoPE) and value into the cache, round half to even and saturating, and attends over the cache as stored,
the new tokens included, and a row's bits do not depend on the other rows of its call (measured against ONNX Runtime
1.32: tests/builder/quantize/test_kv_int8.py). With calls padded as for int8 activations (plan.pad_rows, checked on the
running CPU by the row-invariance probe), chain speculation stays exact against the `none` engine built the same
way; branching trees are exact with int8 activations on specbuild's ordered attention (runtime/kernels) and
labelled lossy with float activations (engine_manifest.lossy_reason). Against the float cache the output changes
(an engine precision, like --weights int4): the build records how much on a sample text.

The scales are static, one per layer for keys and one for values: the largest |key| and |value| the float network
produces on a calibration text (the tokenizer's, else a fixed draw of tokens), times MARGIN, over 127. The graph is
exported and validated with a float cache, then its GroupQueryAttention nodes take the scales and the KV inputs and
outputs become int8 (`quantize_kv_cache`: the graph file only, the weights stay as written), as blockwise weights are
written after the float graph is validated.
"""

from __future__ import annotations

import numpy as np
import torch

from specbuild import engine_format as ef

QMAX = 127
MARGIN = 1.25  # headroom over the calibration text's largest |key| / |value| before values saturate
CALIBRATION_TOKENS = 256
# what the scales are calibrated on (repeated up to CALIBRATION_TOKENS): code, prose, a chat turn, numbers
CALIBRATION_TEXT = (
    "<|im_start|>user\nWrite a function that returns the n-th Fibonacci number.<|im_end|>\n<|im_start|>assistant\n"
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n'
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "The capital of France is Paris; it lies on the Seine, 450 km from the sea. In 2024 the city had about 2.1 "
    "million inhabitants. Speculative decoding drafts several tokens and verifies them in one pass of the target "
    "model, which keeps its output exactly as if it had decoded one token at a time.\n"
    "| year | revenue (M$) | growth |\n| 2023 | 1,284.5 | +12.3% |\n| 2024 | 1,391.0 | +8.3% |\n"
)
MSFT = "com.microsoft"


def calibration_ids(ckpt, text: str = CALIBRATION_TEXT, length: int = CALIBRATION_TOKENS) -> list[int]:
    """Token ids of `text` by the checkpoint's tokenizer (repeated up to `length`), else a fixed draw."""
    vocab = ckpt.model.vocab_size
    if ckpt.tokenizer_file is not None:
        from specbuild.runtime.text import TextCodec

        ids = TextCodec(ckpt.tokenizer_file).encode(text)
        if len(ids) >= 8 and max(ids) < vocab:
            return (ids * (length // len(ids) + 1))[:length]
    return np.random.default_rng(0).integers(0, vocab, size=length).tolist()


def calibrate(net, prompt_ids: list[int]) -> np.ndarray:
    """Scales [L, 2] (key, value) of each decoder layer of `net` (LlamaNetwork, float) from one prefill of
    `prompt_ids`: the largest |key| after RoPE and |value| of the layer, times MARGIN, over QMAX."""
    cfg = net.cfg
    t = len(prompt_ids)
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    positions = torch.arange(t).unsqueeze(0)
    chain = torch.tril(torch.ones(1, t, t, dtype=torch.bool))
    dtype = net.norm.weight.dtype
    empty = torch.zeros(cfg.num_layers, 2, 1, cfg.num_kv_heads, 0, cfg.head_dim, dtype=dtype)
    with torch.no_grad():
        _, new_kv, _ = net(ids, positions, chain, torch.zeros(1, dtype=torch.int64), empty)  # [L,2,1,Hkv,T,D]
    amax = new_kv.float().abs().amax(dim=(2, 3, 4, 5)).numpy()
    return (np.maximum(amax, 1e-6) * MARGIN / QMAX).astype(np.float32)


def quantize_kv_cache(onnx_path, scales: np.ndarray) -> int:
    """Turn the GroupQueryAttention nodes of the graph file at `onnx_path` to an int8 cache with `scales` [L, 2]
    (in node order: one node a decoder layer): their past inputs and present outputs -- graph inputs and outputs the
    runtime binds in place -- become int8. The graph file is rewritten, its weights (external data) are not touched.
    Returns the number of nodes."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.domain == MSFT]
    if len(nodes) != len(scales):
        raise ValueError(f"{len(nodes)} GroupQueryAttention nodes for the scales of {len(scales)} layers")
    inputs = {value.name: value for value in graph.input}
    outputs = {value.name: value for value in graph.output}
    for layer, node in enumerate(nodes):
        names = list(node.input) + [""] * max(0, 14 - len(node.input))
        for slot, which in ((12, 0), (13, 1)):
            names[slot] = f"kv_int8.layer{layer}.{'kv'[which]}_scale"
            scale = float(scales[layer, which])
            graph.initializer.append(helper.make_tensor(names[slot], TensorProto.FLOAT, [1], [scale]))
        del node.input[:]
        node.input.extend(names)
        buffers = ((names[3], inputs), (names[4], inputs), (node.output[1], outputs), (node.output[2], outputs))
        for name, table in buffers:
            if name not in table:
                raise ValueError(f"{node.name}: {name} is not a graph input / output (the in-place KV buffer)")
            table[name].type.tensor_type.elem_type = TensorProto.INT8
        node.attribute.extend(
            [
                helper.make_attribute("kv_cache_bit_width", 8),
                helper.make_attribute("k_quant_type", "PER_TENSOR"),
                helper.make_attribute("v_quant_type", "PER_TENSOR"),
            ]
        )
    onnx.save(model, str(onnx_path))
    return len(nodes)


def kv_quantizer(plan, reference, log):
    """(quantize_kv_cache of a graph file, engine.yaml's kv_quantization entry without its measures) for an int8 cache,
    its scales calibrated on `reference` (the float torch network); (None, None) for a float cache."""
    if plan.options.kv_cache != ef.KV_CACHE_INT8:
        return None, None
    ids = calibration_ids(plan.checkpoint)
    scales = calibrate(reference, ids)
    log(
        f"KV cache int8: scales per layer calibrated on {len(ids)} tokens (keys {scales[:, 0].min():.3g}.."
        f"{scales[:, 0].max():.3g}, values {scales[:, 1].min():.3g}..{scales[:, 1].max():.3g})"
    )
    entry = {"bits": 8, "scales": "per layer, per tensor", "calibration_tokens": len(ids), "margin": MARGIN}
    return (lambda onnx_path: quantize_kv_cache(onnx_path, scales)), entry
