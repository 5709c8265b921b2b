"""One matmul K x N alone under ONNX Runtime (2 threads): ms per call (median) against the rows of the call, for the
kernels an engine can hold -- fp32 MatMul, MatMulNBits int4 / int8 with int8 activations (level 4) and with float
activations (level 1), int4 level 4 under the session setting `mlas.qnbit.force_fp32` (MLAS's float path for 4-bit
weights at every row count), the integer GEMM of `--weights int8 --int8-activations`
(builder/quantize/int8_gemm.py, built by the same code) and specbuild's own BlockInt4MatMul (runtime/kernels, on the
graph an int4 engine holds, with int8 and with float activations; skipped where the library cannot be built). Checks
which kernels give a row the same bits alone and among others. The kernel test of
docs/benchmarks/2026-12-03-run-AM-integer-gemm.md; with BLOCKS, int4 at each of those block sizes too (run AQ);
specbuild's kernel in runs AT and AU.

    python scripts/matmul-rows.py 2048 8192 [ROWS, e.g. 1,16,256] [BLOCKS, e.g. 64,128,256]
"""

import copy
import sys
import time

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specbuild.builder.quantize.blockwise import integer_matmuls

ROWS = tuple(int(r) for r in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,8,16,32,64").split(","))
BLOCKS = tuple(int(b) for b in sys.argv[4].split(",")) if len(sys.argv) > 4 else ()


def matmul_model(k: int, n: int, weight: np.ndarray):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])], [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def nbits(model, bits: int, block: int = 32, level: int = 4):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=level, bits=bits)
    quantizer = MatMulNBitsQuantizer(copy.deepcopy(model), algo_config=config)  # it rewrites the model it is given
    quantizer.process()
    return quantizer.model.model


def integer_gemm(model):
    rewritten = ir.from_proto(model)
    integer_matmuls(rewritten, lambda node: True)
    return ir.to_proto(rewritten)


def own_kernel(weight: np.ndarray, activations: str = "int8"):
    """The int4 engine graph of `weight` (DequantizeLinear, blocks of 32 along K, + MatMul) on specbuild's kernel,
    with int8 or float activations."""
    from specbuild.runtime import kernels
    from specbuild.runtime.kernels.rewrite import use_kernels

    k, n = weight.shape
    blocks = weight.reshape(k // 32, 32, n)
    scale = (np.abs(blocks).max(axis=1) / 7).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, None]), -8, 7).astype(np.int8).reshape(k, n)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w", "s"], ["wd"], axis=0, block_size=32),
         helper.make_node("MatMul", ["x", "wd"], ["y"], name="proj")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        [helper.make_tensor("w", TensorProto.INT4, (k, n), q.reshape(-1)), numpy_helper.from_array(scale, "s")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    return model if kernels.library() is not None and use_kernels(model, matmuls=activations) else None


def session(model, config: dict | None = None):
    from specbuild.runtime import kernels

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    if any(node.domain == "specbuild.kernels" for node in model.graph.node):
        kernels.register(options)
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ms(run, x, reps: int) -> float:
    for _ in range(3):
        run(None, {"x": x})
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def main(k: int, n: int) -> None:
    weight = (np.random.default_rng(1).standard_normal((k, n)) * 0.02).astype(np.float32)
    base = matmul_model(k, n, weight)
    int4 = nbits(base, 4)
    kernels = {"fp32 MatMul": base, "MatMulNBits int4 level 4": int4,
               "MatMulNBits int4 level 1": nbits(base, 4, level=1),
               "MatMulNBits int4 L4 force_fp32": (int4, {"mlas.qnbit.force_fp32": "1"}),
               "MatMulNBits int8 level 4": nbits(base, 8), "integer GEMM (int8_gemm)": integer_gemm(base)}  # fmt: skip
    kernels.update({f"MatMulNBits int4 L4 block {b}": nbits(base, 4, b) for b in BLOCKS})
    for activations in ("int8", "float"):
        own = own_kernel(weight, activations)
        if own is not None:
            kernels[f"specbuild BlockInt4MatMul {activations}"] = own
    reps = 60 if k * n < 5e6 else 20
    x = np.random.default_rng(2).standard_normal((max(ROWS), k)).astype(np.float32)
    print(f"{k} x {n}: ms per call by rows {ROWS}")
    for name, model in kernels.items():
        model, config = model if isinstance(model, tuple) else (model, None)
        run = session(model, config).run
        print(f"{name:32s}", " ".join(f"{ms(run, x[:rows], reps):8.3f}" for rows in ROWS), flush=True)
        full = run(None, {"x": x})[0]
        same = all(
            np.array_equal(run(None, {"x": x[i : i + r]})[0], full[i : i + r]) for r in (1, 2, 3, 5, 16) for i in (0, 7)
        )
        print(f"{'':32s} a row's bits alone and among others: {'the same' if same else 'differ'}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
