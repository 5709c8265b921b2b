"""One attention call alone under ONNX Runtime: ms per call (best of 7 rounds) of ONNX Runtime's GroupQueryAttention
against specbuild's OrderedAttention (runtime/kernels), float and int8 cache, the KV buffers bound in place as the
engines bind them, for the calls an engine makes: a decode step (padded to 2 rows), a tree of 8 nodes, 16 sequences
decoding, a 200-token prompt. Also checks which kernel gives a tree node the bits one-token decoding gives its token.

    python scripts/attention-rows.py [HEADS KV_HEADS HEAD_DIM] [THREADS]   (default: SmolLM2's 9 3 64, 2 threads)
"""

import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from specbuild.runtime import kernels

HEADS, KV_HEADS, DIM = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (9, 3, 64)
THREADS = int(sys.argv[4]) if len(sys.argv) > 4 else 2
CAPACITY = 520
SCALES = (0.05, 0.04)
# (label, sequences, rows, cached tokens, tree)
CALLS = [("decode step", 1, 2, 256, False), ("tree of 8", 1, 8, 256, True), ("16 sequences", 16, 2, 256, False),
         ("decode at 500", 1, 2, 500, False), ("prompt of 200", 1, 200, 0, False)]  # fmt: skip


def model(ours: bool, int8: bool, tree: bool):
    names = ["qkv", "", "", "pk", "pv", "sk", "tot", "cos", "sin", "pos" if tree else "", "bias" if tree else ""]
    names += ["", "ks" if int8 else "", "vs" if int8 else "", "", "", "ql"]
    cache = TensorProto.INT8 if int8 else TensorProto.FLOAT
    if ours:
        op, domain = ("OrderedAttentionInt8" if int8 else "OrderedAttention"), "specbuild.kernels"
        attrs = dict(scale=0.0, softcap=0.0, local_window_size=-1)
    else:
        op, domain, attrs = "GroupQueryAttention", "com.microsoft", dict(do_rotary=1)
        attrs |= dict(kv_cache_bit_width=8, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR") if int8 else {}
    node = helper.make_node(op, names, ["out", "pk_out", "pv_out"], domain=domain, num_heads=HEADS,
                            kv_num_heads=KV_HEADS, **attrs)  # fmt: skip
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    types = {"qkv": (f, ["b", "t", (HEADS + 2 * KV_HEADS) * DIM]), "pk": (cache, ["b", KV_HEADS, CAPACITY, DIM]),
             "pv": (cache, ["b", KV_HEADS, CAPACITY, DIM]), "sk": (i32, ["b"]), "tot": (i32, []),
             "cos": (f, [CAPACITY, DIM // 2]), "sin": (f, [CAPACITY, DIM // 2]), "pos": (TensorProto.INT64, ["b", "t"]),
             "bias": (f, ["b", 1, "t", CAPACITY]), "ks": (f, [1]), "vs": (f, [1]), "ql": (i32, ["b"])}  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, *types[n]) for n in names if n]
    outputs = [helper.make_tensor_value_info(n, cache if n != "out" else f, None) for n in ("out", "pk_out", "pv_out")]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    opsets += [helper.make_opsetid("specbuild.kernels", 1)] if ours else []
    graph = helper.make_graph([node], "attention", inputs, outputs)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    if ours:
        kernels.register(options)
    return ort.InferenceSession(helper.make_model(graph, opset_imports=opsets).SerializeToString(), options)


def feeds(sequences: int, rows: int, past: int, tree: bool, int8: bool, rng) -> dict:
    qkv = rng.standard_normal((sequences, rows, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (CAPACITY, DIM // 2)).astype(np.float32)
    cache = rng.standard_normal((2, sequences, KV_HEADS, CAPACITY, DIM)).astype(np.float32)
    if int8:
        cache = np.clip(np.rint(cache / 0.05), -128, 127).astype(np.int8)
    out = {"qkv": qkv, "pk": cache[0], "pv": cache[1], "sk": np.full(sequences, past + rows - 1, np.int32),
           "tot": np.array(CAPACITY, np.int32), "cos": np.cos(angles), "sin": np.sin(angles),
           "ql": np.full(sequences, rows, np.int32)}  # fmt: skip
    if int8:
        out |= {"ks": np.array([SCALES[0]], np.float32), "vs": np.array([SCALES[1]], np.float32)}
    if tree:  # a chain's mask as a bias, at explicit positions: the tree path of the kernels
        out["pos"] = np.tile(np.arange(past, past + rows), (sequences, 1))
        bias = np.full((sequences, 1, rows, CAPACITY), -np.inf, np.float32)
        for r in range(rows):
            bias[:, 0, r, : past + r + 1] = 0
        out["bias"] = bias
    return out


def timed(session, values: dict, rounds: int = 7) -> float:
    """ms per call, best of `rounds`, the cache buffers bound in place as past inputs and present outputs."""
    binding = session.io_binding()
    for name, value in values.items():
        if name not in ("pk", "pv"):
            binding.bind_cpu_input(name, value)
    for name in ("pk", "pv"):
        buffer = ort.OrtValue.ortvalue_from_numpy(values[name].copy())
        binding.bind_ortvalue_input(name, buffer)
        binding.bind_ortvalue_output(name + "_out", buffer)
    binding.bind_output("out")
    for _ in range(5):
        session.run_with_iobinding(binding)
    best, calls = float("inf"), 0
    for _ in range(rounds):
        start = time.perf_counter()
        calls = 0
        while time.perf_counter() - start < 0.2:
            session.run_with_iobinding(binding)
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def tree_rows_as_decoded(ours: bool, int8: bool) -> bool:
    """Does a tree node (a sibling before it in the call) get the bits its token gets decoded alone?"""
    rng = np.random.default_rng(3)
    values = feeds(1, 3, 40, True, int8, rng)
    values["pos"][:] = [[40, 41, 41]]  # node 2 is a sibling of node 1: it sees the cache, node 0 and itself
    values["bias"][0, 0, 2, 41] = -np.inf
    values["bias"][0, 0, 2, 42] = 0
    tree = model(ours, int8, True).run(None, values)[0][0, 2]
    chain = {**values, "qkv": values["qkv"][:, [0, 2]], "sk": np.array([41], np.int32), "ql": np.array([2], np.int32)}
    del chain["pos"], chain["bias"]
    decoded = model(ours, int8, False).run(None, chain)[0][0, 1]
    return bool(np.array_equal(tree, decoded))


if __name__ == "__main__":
    if kernels.library() is None:
        sys.exit(f"no kernel library: {kernels.description()}")
    print(f"{HEADS}/{KV_HEADS} heads x {DIM}, {THREADS} threads, {kernels.description()}")
    for int8 in (False, True):
        cache = "int8 cache" if int8 else "float cache"
        for ours in (False, True):
            name = "OrderedAttention" if ours else "GroupQueryAttention"
            print(f"{name} ({cache}): a tree node's bits as decoded: {tree_rows_as_decoded(ours, int8)}")
        for label, sequences, rows, past, tree in CALLS:
            rng = np.random.default_rng(0)
            values = feeds(sequences, rows, past, tree, int8, rng)
            stock, own = (timed(model(ours, int8, tree), values) for ours in (False, True))
            print(f"  {cache}, {label:14s}: GroupQueryAttention {stock:7.3f} ms  OrderedAttention {own:7.3f} ms  "
                  f"({own / stock:.2f}x)")  # fmt: skip
