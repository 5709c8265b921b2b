"""lean_preparation: a program of operators ONNX implements and one-to-one renamings is decomposed without torch's
second trace, to a graph that computes the same; any other program goes to torch's own decomposition. Type promotion
from the program's values inserts the casts torch's pass inserts."""

import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch.onnx._internal.exporter import _decomp, _fx_passes, _registration

from specbuild.builder.export.lean_prepare import decomposed_in_place, lean_preparation, promoted_in_place
from specbuild.builder.network.acceptance import branch


class Renamed(torch.nn.Module):
    """Every renaming (&, |, 1 - x, .to to another dtype and to its own), a narrow, an If and size arithmetic."""

    def forward(self, x, m):
        n = x.shape[1]
        both = (m & (x > 0)) | (x < -1)
        y = (1 - x).to(torch.float64).to(torch.float64) * 2
        head = x.narrow(1, 0, n - 1).to(torch.float32)
        z = branch(m.any(), lambda y: y + 1.0, lambda y: y - 1.0, (y,))
        return both, z, head


class Promoted(torch.nn.Module):
    """Ops whose inputs differ in dtype (the type promotion pass casts them), in the program and in an If."""

    def forward(self, x, m):
        counts = m.to(torch.int64).sum(-1, keepdim=True)  # int64
        y = x * counts + m.shape[1]  # float * int64 + size
        z = branch(m.any(), lambda y, c: y / c, lambda y, c: y - c, (y, counts))
        return torch.where(m, z, counts), counts + 0.5


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


@pytest.mark.parametrize("module, expect_lean", [(Renamed(), True), (Identity(), False), (Promoted(), True)])
def test_exported_graph_computes_what_torch_does(module, expect_lean, monkeypatch):
    traced = []
    original = _fx_passes.decompose_with_registry
    monkeypatch.setattr(_fx_passes, "decompose_with_registry", lambda p, r: traced.append(1) or original(p, r))
    args = (torch.randn(3, 5),) if isinstance(module, Identity) else _args()
    dims = torch.export.Dim("n", min=3, max=64)
    with warnings.catch_warnings(), torch.no_grad(), lean_preparation():
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


def test_type_promotion_from_the_programs_values_inserts_the_same_casts():
    graphs = []
    for promote in (_fx_passes.insert_type_promotion_nodes, promoted_in_place):
        program = _program(Promoted(), _args())
        assert decomposed_in_place(program, _implemented())
        promote(program.graph_module)
        graphs.append([str(m.graph) for m in program.graph_module.modules()])
    assert graphs[0] == graphs[1]
    assert "convert_element_type" in graphs[1][0]  # casts inserted (the test covers the pass's work)
