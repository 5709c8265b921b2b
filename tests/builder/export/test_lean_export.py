"""builder/export/lean_export: the tracer's and optimizer's settings change the cost of an export, never its graph."""

from __future__ import annotations

import warnings

import onnx_ir as ir
import onnxscript.optimizer
import torch
import torch._dynamo.config as dynamo_config
import torch.fx.config as fx_config
from onnxscript import rewriter

from specbuild.builder.export import lean_export
from specbuild.builder.network.layers import apply_rope


class _RopeAndCasts(torch.nn.Module):
    """What a step graph gives the rewrite rules: RoPE's halves, reshapes, casts, an unsqueeze pair."""

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        y = apply_rope(x.reshape(b, t, 2, d // 2), cos, sin).reshape(b, t, d)
        y = y.to(torch.float16).to(torch.float32).unsqueeze(0).unsqueeze(0)
        return y.transpose(-1, -2).transpose(-1, -2) + x[..., : d // 2].sum(-1, keepdim=True)


def _nodes(model) -> list[tuple]:
    """Each node's op and the ops feeding it (value names differ between two runs of the optimizer)."""
    return [
        (n.op_type, tuple(v.producer().op_type if v and v.producer() else "-" for v in n.inputs)) for n in model.graph
    ]


def test_skipped_rules_are_onnxscripts_and_the_graph_is_the_same_without_them():
    rules = rewriter._DEFAULT_REWRITE_RULES
    names = {getattr(rule, "name", None) for rule in rules}
    assert lean_export.SKIPPED_RULES <= names  # a renamed rule would run again: noticed here
    x, cos, sin = torch.randn(2, 3, 8), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    dim = torch.export.Dim("t", min=2, max=64)
    with warnings.catch_warnings():  # torch's own deprecations, and the axis shared by three inputs
        warnings.simplefilter("ignore")
        traced = torch.onnx.export(
            _RopeAndCasts().eval(),
            (x, cos, sin),
            dynamo=True,
            optimize=False,
            dynamic_shapes=({1: dim}, {0: dim}, {0: dim}),
        ).model
    reference, lean = traced, ir.from_proto(ir.to_proto(traced))
    unoptimized = _nodes(traced)
    onnxscript.optimizer.optimize_ir(reference)
    lean_export.optimize(lean)
    assert _nodes(lean) == _nodes(reference) != unoptimized
    assert rewriter._DEFAULT_REWRITE_RULES is rules  # restored


def test_lean_tracing_sets_and_restores_the_tracers_settings():
    before = (fx_config.do_not_emit_stack_traces, dynamo_config.fake_tensor_cache_enabled)
    with lean_export.lean_tracing():
        assert fx_config.do_not_emit_stack_traces is True
        assert dynamo_config.fake_tensor_cache_enabled is False
    assert (fx_config.do_not_emit_stack_traces, dynamo_config.fake_tensor_cache_enabled) == before
