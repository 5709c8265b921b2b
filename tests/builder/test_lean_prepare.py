"""lean_decomposition: a program of operators ONNX implements and one-to-one renamings is decomposed without torch's
second trace, to a graph that computes the same; any other program goes to torch's own decomposition."""

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.onnx._internal.exporter import _decomp, _fx_passes, _registration

from specbuild.builder.acceptance import branch
from specbuild.builder.lean_prepare import decomposed_in_place, lean_decomposition


class Renamed(torch.nn.Module):
    """Every renaming (&, |, 1 - x, .to to another dtype and to its own), a narrow, an If and size arithmetic."""

    def forward(self, x, m):
        n = x.shape[1]
        both = (m & (x > 0)) | (x < -1)
        y = (1 - x).to(torch.float64).to(torch.float64) * 2
        head = x.narrow(1, 0, n - 1).to(torch.float32)
        z = branch(m.any(), lambda y: y + 1.0, lambda y: y - 1.0, (y,))
        return both, z, head


class Identity(torch.nn.Module):
    """torch.eye: an operator ONNX has no function for (decomposed by torch)."""

    def forward(self, x):
        return x + torch.eye(x.shape[1], dtype=x.dtype)[0]


class InPlace(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1.0)
        return y


def _program(module, args):
    dims = torch.export.Dim("n", min=3, max=64)
    shapes = tuple({1: dims} if a.dim() > 1 else None for a in args)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, dynamic_shapes=shapes)


def _implemented():
    return set(_decomp.get_onnx_implemented_overloads(_registration.ONNXRegistry.from_torchlib()))


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 5, generator=g), torch.rand(3, 5, generator=g) > 0.5


def test_a_program_of_renamings_is_decomposed_in_place():
    program = _program(Renamed(), _args())
    assert decomposed_in_place(program, _implemented())
    targets = {n.target for m in program.graph_module.modules() for n in m.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    assert aten.bitwise_and.Tensor in targets and aten.bitwise_or.Tensor in targets and aten.sub.Tensor in targets
    assert not targets & {aten.__and__.Tensor, aten.__or__.Tensor, aten.rsub.Scalar, aten.to.dtype}
    copies = [n for n in program.graph_module.graph.nodes if n.target is aten._to_copy.default]
    # the second .to(float64): x itself; .to(float32) of a float32 output: a copy (the signature names the node)
    assert [n.kwargs["dtype"] for n in copies] == [torch.float64, torch.float32]
    x, m = _args()
    for got, want in zip(program.module()(x, m), Renamed()(x, m)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("module", [Identity(), InPlace()])
def test_anything_else_is_left_to_torch(module):
    program = _program(module, (torch.randn(3, 5),))
    before = str(program.graph_module.graph)
    assert not decomposed_in_place(program, _implemented())
    assert str(program.graph_module.graph) == before


@pytest.mark.parametrize("module, expect_lean", [(Renamed(), True), (Identity(), False)])
def test_exported_graph_computes_what_torch_does(module, expect_lean, monkeypatch):
    traced = []
    original = _fx_passes.decompose_with_registry
    monkeypatch.setattr(_fx_passes, "decompose_with_registry", lambda p, r: traced.append(1) or original(p, r))
    args = _args() if isinstance(module, Renamed) else (torch.randn(3, 5),)
    dims = torch.export.Dim("n", min=3, max=64)
    with warnings.catch_warnings(), torch.no_grad(), lean_decomposition():
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(
            module, args, dynamo=True, verbose=False,
            dynamic_shapes=tuple({1: dims} if a.dim() > 1 else None for a in args),
        )  # fmt: skip
    assert traced == ([] if expect_lean else [1])
    session = ort.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for width in (4, 7):  # another size than the traced one
        g = torch.Generator().manual_seed(width)
        feed = (torch.randn(3, width, generator=g), torch.rand(3, width, generator=g) > 0.5)[: len(args)]
        got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), feed)})
        want = module(*feed)
        for g_out, w_out in zip(got, want if isinstance(want, tuple) else (want,)):
            np.testing.assert_array_equal(g_out, w_out.numpy())
