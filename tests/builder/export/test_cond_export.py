"""lean_cond_passes: an If whose branch graphs plainly neither mutate nor alias their inputs is exported without
torch's tracing checks, to the same graph; any other branch is checked as before (a mutating one is refused). A cond's
fake outputs are read from its traced branch graphs, not from running them again, where the graphs show them."""

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch._higher_order_ops import utils as hop_utils
from torch._higher_order_ops.cond import cond_op
from torch._subclasses.fake_tensor import FakeTensorMode

from specbuild.builder.export.cond_export import lean_cond_passes, plainly_functional, traced_outputs
from specbuild.builder.network.acceptance import branch


class Nested(torch.nn.Module):
    """An If whose true branch holds another If (as the acceptance graphs nest them)."""

    def forward(self, x, n):
        def inner_true(x, n):
            return branch(n.sum() > 1, lambda x: x * 3.0, lambda x: x - 1.0, (x,))

        return branch(n.sum() > 0, inner_true, lambda x, n: x + 2.0, (x, n))


class Mutating(torch.nn.Module):
    """A branch that writes into its operand: the first pass must still refuse it."""

    def forward(self, x, n):
        def true_fn(x):
            x.add_(1.0)
            return (x.clone(),)

        return cond_op(n.sum() > 0, true_fn, lambda x: (x.clone(),), (x.clone(),))


def _export(module, lean: bool):
    args = (torch.randn(2, 3), torch.ones(2, dtype=torch.int64))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if not lean:
            return torch.onnx.export(module, args, dynamo=True, verbose=False).model_proto
        with lean_cond_passes():
            return torch.onnx.export(module, args, dynamo=True, verbose=False).model_proto


@pytest.fixture
def counted(monkeypatch):
    """The calls of torch's own checks (a list of branch kinds, one per call)."""
    calls = []
    original_check, original_schema = hop_utils._check_alias_and_mutation, cond_op.gen_schema

    def counting_check(graph_module, *rest):
        calls.append("check")
        return original_check(graph_module, *rest)

    def counting_schema(pred, true_fn, false_fn, operands):
        calls.append("schema")
        return original_schema(pred, true_fn, false_fn, operands)

    monkeypatch.setattr(hop_utils, "_check_alias_and_mutation", counting_check)
    monkeypatch.setattr(cond_op, "gen_schema", counting_schema)
    yield calls
    assert hop_utils._check_alias_and_mutation is counting_check  # put back as they were
    assert cond_op.gen_schema is counting_schema


@pytest.fixture
def fake_runs(monkeypatch):
    """The runs of the cond operator's own fake-tensor kernel (each interprets both branch graphs again)."""
    runs = []
    original = cond_op.python_key_table[FakeTensorMode]

    def counting(*args):
        runs.append(1)
        return original(*args)

    monkeypatch.setitem(cond_op.python_key_table, FakeTensorMode, counting)
    yield runs
    assert cond_op.python_key_table[FakeTensorMode] is counting  # put back as it was


def test_same_graph_without_the_tracing_checks(counted, fake_runs):
    plain = _export(Nested(), lean=False)
    assert "check" in counted and "schema" in counted
    runs_plain = len(fake_runs)
    counted.clear()
    fake_runs.clear()
    lean = _export(Nested(), lean=True)
    assert counted == []
    # the trace reads both Ifs' outputs from their graphs; the exporter's later passes (here torch's own
    # decomposition, which retraces under another fake mode) still run them
    assert len(fake_runs) < runs_plain // 2
    assert onnx.printer.to_text(lean.graph) == onnx.printer.to_text(plain.graph)

    session = ort.InferenceSession(lean.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for n, expected in (([1, 1], x * 3), ([1, 0], x - 1), ([0, 0], x + 2)):
        feeds = dict(zip([i.name for i in session.get_inputs()], (x, np.array(n, dtype=np.int64))))
        np.testing.assert_array_equal(session.run(None, feeds)[0], expected)


def test_a_branch_mutating_its_input_is_still_refused(counted):
    with pytest.raises(Exception) as plain:
        _export(Mutating(), lean=False)
    counted.clear()
    with pytest.raises(Exception) as lean:
        _export(Mutating(), lean=True)
    assert "schema" in counted  # asked torch, as without
    assert "is not functional" in str(lean.value) and str(lean.value) == str(plain.value)


def _graph(fn, *args) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


@pytest.mark.parametrize(
    "fn, plain",
    [
        (lambda x: (x.view(-1).exp().clone(),), True),  # views inside, a fresh output
        (lambda x: (x * 2, x + 1), True),
        (lambda x: (x.view(-1),), False),  # an output that is a view of the input
        (lambda x: (x,), False),  # the input itself
        (lambda x: (x.split(1)[0],), False),  # an element of a tuple of views
        (lambda x: (x.topk(2).values,), True),  # an element of a fresh tuple
        (lambda x: ((y := x * 2), y), False),  # one tensor twice
        (lambda x: (x.add_(1) * 2,), False),  # written in place
    ],
)
def test_plainly_functional(fn, plain):
    assert plainly_functional(_graph(fn, torch.randn(2, 3)), cond_op) is plain


def test_traced_outputs_only_for_the_operands_traced():
    """A branch graph's outputs stand for a run only on tensors like those it was traced from."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.randn(2, 3))
    graph = make_fx(lambda x: ((x * 2).sum(-1), x + 1), tracing_mode="fake")(x)
    shown = traced_outputs(graph, (x,), mode)
    assert shown is not None and [tuple(t.shape) for t in shown[0]] == [(2,), (2, 3)]
    assert traced_outputs(graph, (mode.from_tensor(torch.randn(4, 3)),), mode) is None  # other sizes: run it
    assert traced_outputs(graph, (x,), FakeTensorMode()) is None  # another mode's tensors
    assert traced_outputs(lambda x: x, (x,), mode) is None  # not a graph
