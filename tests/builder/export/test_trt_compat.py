"""Tests for the TensorRT ONNX lint (trt_compat) and the import-safety of the TensorRT plan builder/backend."""

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specbuild.builder.export import tensorrt_plan
from specbuild.builder.export.trt_compat import assert_tensorrt_clean, lint_onnx_for_tensorrt, operator_matrix
from specbuild.errors import SpecbuildError


def _model(nodes, inputs, outputs, initializers=(), opset=18, functions=(), extra_opsets=()):
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset), *extra_opsets]
    return helper.make_model(graph, opset_imports=opsets, functions=list(functions), ir_version=9)


def _axis(name="axis", value=1):
    return numpy_helper.from_array(np.array(value, dtype=np.int64), name)


def _float_cumsum_model(opset=18):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("CumSum", ["x", "axis"], ["c"], name="cs"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Softmax", ["r"], ["y"], name="sm", axis=-1),
    ]
    return _model(nodes, [x], [y], [_axis()], opset=opset)


def test_matrix_names_version_source_and_opsets():
    m = operator_matrix()
    assert m["tensorrt_version"].startswith("10.")
    assert "onnx-tensorrt" in m["source_url"] and m["source_url"].endswith("docs/operators.md")
    assert m["opset_min"] == 9 and m["opset_max"] >= 20
    assert m["supported"]["CumSum"]["types"] == ["FP32", "FP16", "BF16"]
    assert "Unique" in m["unsupported"] and "NonZero" in m["supported"]


def test_clean_graph_passes():
    model = _float_cumsum_model()
    onnx.checker.check_model(model)
    assert lint_onnx_for_tensorrt(model) == []
    assert_tensorrt_clean(model)


def test_clean_graph_from_path(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_float_cumsum_model(), str(path))
    assert lint_onnx_for_tensorrt(path) == []
    assert lint_onnx_for_tensorrt(str(path)) == []


def test_unsupported_op_flagged():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = _model([helper.make_node("Unique", ["x"], ["y"], name="uniq")], [x], [y])
    problems = lint_onnx_for_tensorrt(model)
    assert len(problems) == 1 and "'uniq' (Unique)" in problems[0] and "does not support Unique" in problems[0]
    with pytest.raises(SpecbuildError, match="Unique"):
        assert_tensorrt_clean(model)


def test_unknown_op_flagged():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    model = _model([helper.make_node("SomeFutureOp", ["x"], ["y"], name="f")], [x], [y])
    (problem,) = lint_onnx_for_tensorrt(model)
    assert "SomeFutureOp is not in TensorRT" in problem


def test_cumsum_on_int64_flagged():
    x = helper.make_tensor_value_info("x", TensorProto.BOOL, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [2, 3])
    nodes = [
        helper.make_node("Cast", ["x"], ["xi"], name="cast", to=TensorProto.INT64),
        helper.make_node("CumSum", ["xi", "axis"], ["y"], name="cs"),
    ]
    model = _model(nodes, [x], [y], [_axis()])
    (problem,) = lint_onnx_for_tensorrt(model)  # type of 'xi' comes from shape inference
    assert "'cs' (CumSum)" in problem and "INT64" in problem and "FP32" in problem
    # the graph is valid ONNX that ONNX Runtime runs: only TensorRT would reject it
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"x": np.array([[1, 0, 1], [0, 1, 1]], dtype=bool)})[0]
    assert out.tolist() == [[1, 1, 2], [0, 1, 2]]


def test_cumsum_axis_must_be_constant():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    a = helper.make_tensor_value_info("axis", TensorProto.INT64, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    model = _model([helper.make_node("CumSum", ["x", "axis"], ["y"], name="cs")], [x, a], [y])
    (problem,) = lint_onnx_for_tensorrt(model)
    assert "'axis'" in problem and "build-time constant" in problem
    # a Constant node, or a constant-foldable chain, is fine
    nodes = [
        helper.make_node("Constant", [], ["a0"], value=numpy_helper.from_array(np.array(0, dtype=np.int64))),
        helper.make_node("Add", ["a0", "one"], ["a1"]),
        helper.make_node("CumSum", ["x", "a1"], ["y"], name="cs"),
    ]
    one = numpy_helper.from_array(np.array(1, dtype=np.int64), "one")
    assert lint_onnx_for_tensorrt(_model(nodes, [x], [y], [one])) == []


def test_opset_too_high_and_too_low_flagged():
    hi = operator_matrix()["opset_max"]
    (problem,) = lint_onnx_for_tensorrt(_float_cumsum_model(opset=hi + 1))
    assert f"opset {hi + 1}" in problem and f"9 to {hi}" in problem
    assert lint_onnx_for_tensorrt(_float_cumsum_model(opset=20), max_opset=20) == []
    assert any("opset 21" in p for p in lint_onnx_for_tensorrt(_float_cumsum_model(opset=21), max_opset=20))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    old = _model([helper.make_node("Relu", ["x"], ["y"])], [x], [y], opset=8)
    assert any("opset 8" in p for p in lint_onnx_for_tensorrt(old))


def test_non_default_domain_flagged():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    node = helper.make_node("FastGelu", ["x"], ["y"], name="fg", domain="com.microsoft")
    model = _model([node], [x], [y], extra_opsets=[helper.make_opsetid("com.microsoft", 1)])
    (problem,) = lint_onnx_for_tensorrt(model)
    assert "non-standard domain 'com.microsoft'" in problem and "com.microsoft::FastGelu" in problem


def test_ops_inside_local_functions_are_checked():
    fn = helper.make_function(
        "specbuild.local",
        "Dedup",
        ["a"],
        ["b"],
        [helper.make_node("Unique", ["a"], ["b"], name="inner_unique")],
        opset_imports=[helper.make_opsetid("", 18)],
    )
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    call = helper.make_node("Dedup", ["x"], ["y"], name="call", domain="specbuild.local")
    model = _model([call], [x], [y], functions=[fn], extra_opsets=[helper.make_opsetid("specbuild.local", 1)])
    problems = lint_onnx_for_tensorrt(model)
    assert len(problems) == 1 and "Unique" in problems[0]


def test_ops_inside_subgraphs_are_checked():
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    then_g = helper.make_graph(
        [helper.make_node("Unique", ["x"], ["t"], name="then_unique")],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
    )
    else_g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["e"], name="else_relu")],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
    )
    node = helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)
    (problem,) = lint_onnx_for_tensorrt(_model([node], [cond, x], [y]))
    assert "then_unique" in problem and "in If subgraph 'then_branch'" in problem


def test_topk_restrictions():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5000])
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, None)
    i = helper.make_tensor_value_info("i", TensorProto.INT64, None)
    k_ok = numpy_helper.from_array(np.array([10], dtype=np.int64), "k")
    node = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="tk")
    assert lint_onnx_for_tensorrt(_model([node], [x], [v, i], [k_ok])) == []
    k_big = numpy_helper.from_array(np.array([4000], dtype=np.int64), "k")
    assert any("K=4000" in p for p in lint_onnx_for_tensorrt(_model([node], [x], [v, i], [k_big])))
    unsorted = helper.make_node("TopK", ["x", "k"], ["v", "i"], name="tk", sorted=0)
    assert any("sorted=1" in p for p in lint_onnx_for_tensorrt(_model([unsorted], [x], [v, i], [k_ok])))


def test_argmax_on_int64_allowed_and_bool_equal_flagged():
    a = helper.make_tensor_value_info("a", TensorProto.INT64, [2, 3])
    b = helper.make_tensor_value_info("b", TensorProto.BOOL, [2, 3])
    am = helper.make_tensor_value_info("am", TensorProto.INT64, None)
    eq = helper.make_tensor_value_info("eq", TensorProto.BOOL, None)
    nodes = [
        helper.make_node("ArgMax", ["a"], ["am"], name="amax", axis=1),
        helper.make_node("Equal", ["b", "b"], ["eq"], name="beq"),
    ]
    (problem,) = lint_onnx_for_tensorrt(_model(nodes, [a, b], [am, eq]))
    assert "'beq' (Equal)" in problem and "BOOL" in problem


def test_oldest_tensorrt_flags_newer_ops():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])
    s = numpy_helper.from_array(np.ones(8, dtype=np.float32), "scale")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])
    model = _model([helper.make_node("RMSNormalization", ["x", "scale"], ["y"], name="rms")], [x], [y], [s], opset=23)
    assert lint_onnx_for_tensorrt(model) == []
    assert any("10.15 or newer" in p for p in lint_onnx_for_tensorrt(model, oldest_tensorrt="10.1"))


def test_assert_lists_problems_on_one_line():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Unique", ["x"], [f"u{k}"], name=f"u{k}") for k in range(12)]
    nodes.append(helper.make_node("Identity", ["x"], ["y"]))
    with pytest.raises(SpecbuildError) as err:
        assert_tensorrt_clean(_model(nodes, [x], [y]), max_problems=3)
    msg = str(err.value)
    assert "\n" not in msg and "12 problems" in msg and "and 9 more" in msg


def test_unreadable_model_path(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(SpecbuildError, match="cannot read ONNX model"):
        lint_onnx_for_tensorrt(bad)


# ----------------------------------------------------------------------------- TensorRT plan / backend
needs_no_tensorrt = pytest.mark.skipif(tensorrt_plan.tensorrt_available(), reason="TensorRT is installed here")


def test_modules_import_without_tensorrt_or_torch():
    code = (
        "import sys; import specbuild.builder.export.tensorrt_plan, specbuild.runtime.backends.tensorrt; "
        "print('tensorrt' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[1] == "False"  # torch is never imported
    if not tensorrt_plan.tensorrt_available():
        assert out.stdout.split()[0] == "False"


@needs_no_tensorrt
def test_build_plan_without_tensorrt_gives_clear_error(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_float_cumsum_model(), str(path))
    with pytest.raises(SpecbuildError) as err:
        tensorrt_plan.build_tensorrt_plan(path, tmp_path / "m.plan", profiles={"x": ((1, 3), (2, 3), (4, 3))})
    assert str(err.value) == (
        "--tensorrt needs the TensorRT Python package (pip install specbuild[trt]) on an NVIDIA GPU host"
    )
    assert not (tmp_path / "m.plan").exists()


@needs_no_tensorrt
def test_backend_without_tensorrt_gives_clear_error(tmp_path):
    from specbuild.runtime.backends.tensorrt import TensorRTBackend

    with pytest.raises(SpecbuildError, match=r"TensorRT Python package \(pip install specbuild\[trt\]\)"):
        TensorRTBackend(tmp_path, {"files": {"plan": "model.plan"}}, {})
