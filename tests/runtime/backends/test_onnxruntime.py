"""The ONNX Runtime backend's Binding: per-step inputs copied into bound buffers, outputs pre-bound once their
shapes are known, long-lived buffers bound in place -- each call must still see exactly its own inputs and hand
back outputs that later calls do not overwrite."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto

from specbuild.runtime.backends.onnxruntime import SCRATCH_MAX_ELEMENTS, Binding, BoundArray

OUTPUTS = ["doubled", "positive", "buf_out"]


@pytest.fixture(scope="module")
def session():
    """doubled = 2x; positive = NonZero(x > 0) (its shape depends on the values); buf_out = buf + 1 (in place)."""
    nodes = [
        oh.make_node("Mul", ["x", "two"], ["doubled"]),
        oh.make_node("Greater", ["x", "zero"], ["gt"]),
        oh.make_node("NonZero", ["gt"], ["positive"]),
        oh.make_node("Add", ["buf", "one"], ["buf_out"]),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"]),
         oh.make_tensor_value_info("buf", TensorProto.FLOAT, [1, "c"])],
        [oh.make_tensor_value_info("doubled", TensorProto.FLOAT, [1, "n"]),
         oh.make_tensor_value_info("positive", TensorProto.INT64, [2, "k"]),
         oh.make_tensor_value_info("buf_out", TensorProto.FLOAT, [1, "c"])],
        initializer=[oh.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
                     oh.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
                     oh.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_repeated_calls_see_their_own_inputs_and_keep_earlier_outputs(session):
    binding = Binding(session, OUTPUTS)
    buf = BoundArray(np.zeros((1, 4), np.float32))
    aliases = {"buf_out": "buf"}
    results = []
    for step in range(5):  # same shapes every call: from the second call on the outputs are pre-bound
        x = np.array([[step, -1.0, step - 2.0]], np.float32)
        out, _ = binding.run({"x": x, "buf": buf}, aliases)
        x[:] = 99.0  # the caller reusing its array after the call changes nothing
        results.append(out)
    for step, out in enumerate(results):
        np.testing.assert_array_equal(out["doubled"], [[2.0 * step, -2.0, 2.0 * (step - 2.0)]])
    assert results[0]["doubled"] is not results[1]["doubled"]
    assert results[4]["buf_out"] is buf.array  # the aliased output is the caller's buffer, written in place
    np.testing.assert_array_equal(buf.array, np.full((1, 4), 5.0))
    # the aliased output is found by name (not copied into each call's dict): in, get, [] all see it
    last = results[4]
    assert "buf_out" in last and last.get("buf_out") is buf.array and last.get("missing") is None
    assert "missing" not in last and set(last) == {"doubled", "positive"}
    with pytest.raises(KeyError):
        last["missing"]


def test_shapes_changing_between_calls(session):
    binding = Binding(session, OUTPUTS)
    buf = BoundArray(np.zeros((1, 2), np.float32))
    for n in (1, 3, 3, 1, 1, 6, 3):
        x = np.arange(n, dtype=np.float32)[None] + 1
        out, _ = binding.run({"x": x, "buf": buf}, {"buf_out": "buf"})
        np.testing.assert_array_equal(out["doubled"], 2 * x)
        assert out["positive"].shape == (2, n)


def test_value_dependent_output_shape_with_the_same_input_shapes(session):
    """NonZero's output shape changes while the input shapes do not: the pre-bound outputs give way."""
    binding = Binding(session, OUTPUTS)
    buf = BoundArray(np.zeros((1, 2), np.float32))
    for values in ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [-1.0, 2.0, -3.0], [1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]):
        x = np.array([values], np.float32)
        out, _ = binding.run({"x": x, "buf": buf}, {"buf_out": "buf"})
        np.testing.assert_array_equal(out["positive"][1], np.flatnonzero(x[0] > 0))
        np.testing.assert_array_equal(out["doubled"], 2 * x)
    np.testing.assert_array_equal(buf.array, np.full((1, 2), 5.0))  # each call ran its in-place update once


def test_a_new_buffer_moves_the_aliased_output(session):
    """The cache grew: the aliased output must be written into the new buffer, not the old one."""
    binding = Binding(session, OUTPUTS)
    old = BoundArray(np.zeros((1, 2), np.float32))
    binding.run({"x": np.ones((1, 1), np.float32), "buf": old}, {"buf_out": "buf"})
    binding.run({"x": np.ones((1, 1), np.float32), "buf": old}, {"buf_out": "buf"})
    new = BoundArray(np.full((1, 5), 10.0, np.float32))
    out, _ = binding.run({"x": np.ones((1, 1), np.float32), "buf": new}, {"buf_out": "buf"})
    assert out["buf_out"] is new.array
    np.testing.assert_array_equal(new.array, np.full((1, 5), 11.0))
    np.testing.assert_array_equal(old.array, np.full((1, 2), 2.0))


def test_large_plain_inputs_are_bound_without_a_copy(session):
    binding = Binding(session, OUTPUTS)
    buf = BoundArray(np.zeros((1, 2), np.float32))
    n = SCRATCH_MAX_ELEMENTS + 10
    for scale in (1.0, 3.0):
        x = np.linspace(-1, 1, n, dtype=np.float32)[None] * scale
        out, _ = binding.run({"x": x, "buf": buf}, {"buf_out": "buf"})
        np.testing.assert_array_equal(out["doubled"], 2 * x)


def test_long_lived_buffers_come_as_one_mapping_bound_while_it_is_the_same(session):
    binding = Binding(session, OUTPUTS)
    aliases = {"buf_out": "buf"}
    small = BoundArray(np.zeros((1, 4), np.float32))
    buffers = {"buf": small}
    for _ in range(3):  # the same mapping: nothing bound again, the aliased output is still written in place
        out, _ = binding.run({"x": np.ones((1, 2), np.float32)}, aliases, buffers)
        assert out["buf_out"] is small.array
    np.testing.assert_array_equal(small.array, np.full((1, 4), 3.0))
    grown = {"buf": BoundArray(np.zeros((1, 8), np.float32))}  # a new mapping (the cache grew): bound again
    out, _ = binding.run({"x": np.ones((1, 2), np.float32)}, aliases, grown)
    assert out["buf_out"] is grown["buf"].array
    np.testing.assert_array_equal(grown["buf"].array, np.ones((1, 8)))
    np.testing.assert_array_equal(small.array, np.full((1, 4), 3.0))  # the old buffer is left alone
    plain = {"buf": np.zeros((1, 2), np.float32)}  # a plain array is wrapped (once per mapping)
    for _ in range(2):
        out, _ = binding.run({"x": np.ones((1, 2), np.float32)}, aliases, plain)
        assert out["buf_out"] is plain["buf"]
    np.testing.assert_array_equal(plain["buf"], np.full((1, 2), 2.0))
