"""builder/quantize/int8_gemm.py: a MatMul rewritten as the integer GEMM computes what its numpy reference does, row by
row whatever the call's other rows, and the row-invariance probe rebuilds it."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from specbuild.builder.quantize.blockwise import integer_matmuls
from specbuild.builder.quantize.int8_gemm import ACTIVATION_LEVELS, WEIGHT_LEVELS, quantize_columns
from specbuild.runtime.row_invariance import probe_model

K, N = 96, 40


def _matmul_model(weight: np.ndarray) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape(["batch", "rows", K]), type=ir.TensorType(ir.DataType.FLOAT))
    w = ir.Value(name="w", shape=ir.Shape(weight.shape), type=ir.TensorType(ir.DataType.FLOAT))
    w.const_value = ir.Tensor(weight, name="w")
    node = ir.Node("", "MatMul", [x, w], name="proj")
    node.outputs[0].name = "y"
    node.outputs[0].type, node.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["batch", "rows", N])
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=10)


def _session(model: ir.Model):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The module's arithmetic in numpy: rows in 8 bits around 128 (round half to even), weights per column in 7."""
    scale = np.maximum(np.abs(x).max(-1, keepdims=True) * np.float32(1 / ACTIVATION_LEVELS), np.float32(1e-30))
    q = np.clip(np.rint(x / scale), -128, 127).astype(np.int64)
    wq, w_scale = quantize_columns(weight)
    return (q @ wq.astype(np.int64)).astype(np.float32) * w_scale * scale


@pytest.fixture(scope="module")
def weight():
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) * 0.05
    w[:, 3] = 0  # a zero column
    return w


def test_weights_quantize_per_column_within_the_saturation_free_range(weight):
    wq, w_scale = quantize_columns(weight)
    assert wq.dtype == np.int8 and np.abs(wq).max() == WEIGHT_LEVELS and w_scale.shape == (N,)
    assert np.all(np.abs(wq[:, 3]) == 0) and np.isfinite(w_scale).all()
    assert np.abs(wq * w_scale - weight).max() <= w_scale.max() / 2 + 1e-7


def test_rewritten_matmul_equals_its_reference_and_is_row_invariant(weight):
    model = _matmul_model(weight)
    assert integer_matmuls(model, lambda node: True) == 1
    ops = [n.op_type for n in model.graph]
    assert "MatMul" not in ops and "MatMulIntegerToFloat" in ops and "w" not in model.graph.initializers
    assert "QuantizeLinear" in ops and model.opset_imports[""] == 21  # one pass quantizes a row (opset 21's blocks)
    onnx.checker.check_model(ir.to_proto(model))  # the graph output keeps its type (a draft's logits: issue of run AO)
    session = _session(model)
    x = np.random.default_rng(1).standard_normal((2, 16, K)).astype(np.float32)
    x[1, 5] = 0  # a padding row: zeros, not NaN
    full = session.run(None, {"x": x})[0]
    want = _reference(x.reshape(-1, K), weight).reshape(full.shape)
    np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-6)
    assert np.all(full[1, 5] == 0)
    assert np.abs(full - x @ weight).max() < 0.05 * np.abs(x @ weight).max()  # an 8-bit approximation of the float
    for rows in (1, 2, 3, 7):  # each row's bits, whatever the call's other rows
        for start in (0, 9):
            part = session.run(None, {"x": np.ascontiguousarray(x[:1, start : start + rows])})[0]
            assert np.array_equal(part, full[:1, start : start + rows]), (rows, start)


def test_matmuls_on_the_same_rows_share_one_zero_point_tensor(weight):
    model = _matmul_model(weight)
    first = model.graph.node(0)
    w2 = ir.Value(name="w2", shape=ir.Shape((N, K)), type=ir.TensorType(ir.DataType.FLOAT))
    w2.const_value = ir.Tensor(np.ascontiguousarray(weight.T[:, :K] * 2), name="w2")
    model.graph.register_initializer(w2)
    second = ir.Node("", "MatMul", [first.outputs[0], w2], name="proj2")  # rows of the same shape [batch, rows]
    second.outputs[0].type, second.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(["batch", "rows", K])
    model.graph.append(second)
    model.graph.outputs[0] = second.outputs[0]
    assert integer_matmuls(model, lambda node: True) == 2
    assert [n.op_type for n in model.graph].count("Expand") == 1
    x = np.random.default_rng(3).standard_normal((1, 5, K)).astype(np.float32)
    want = _reference(_reference(x[0], weight), weight.T[:, :K] * 2)
    np.testing.assert_allclose(_session(model).run(None, {"x": x})[0][0], want, rtol=1e-4, atol=1e-5)


def test_the_row_invariance_probe_rebuilds_the_integer_gemm(weight):
    model = _matmul_model(weight)
    integer_matmuls(model, lambda node: True)
    verdict = probe_model(ir.to_proto(model), threads=2, accuracy_level=4)
    assert verdict.kernels == {f"MatMulIntegerToFloat {K}x{N}": 1}


def test_the_embedding_in_8_bit_blocks_reads_back_within_half_a_step():
    """quantize_table_rows_int8 feeds GatherBlockQuantized's 8-bit form: (data - 128) * scale, blocks along H (a
    partial last block included)."""
    from onnx import TensorProto, helper, numpy_helper

    from specbuild.builder.quantize.blockwise import quantize_table_rows_int8

    table = np.random.default_rng(3).standard_normal((50, 40)).astype(np.float32)
    table[7] = 0
    data, scales = quantize_table_rows_int8(table, 16)
    assert data.shape == (50, 40) and scales.shape == (50, 3) and data.min() >= 1
    node = helper.make_node("GatherBlockQuantized", ["t", "ids", "s"], ["y"], domain="com.microsoft", bits=8,
                            block_size=16, gather_axis=0, quantize_axis=1)  # fmt: skip
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(data, "t"), numpy_helper.from_array(scales, "s")])  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.arange(50)
    got = session.run(None, {"ids": ids})[0]
    step = np.repeat(scales, 16, axis=1)[:, :40]
    assert np.all(np.abs(got - table) <= step / 2 + 1e-6) and np.all(got[7] == 0)
