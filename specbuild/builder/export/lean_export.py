"""Settings of torch's tracer and of onnxscript's optimizer that make an export cheaper without changing the graph it
writes: no Python stack recorded per node, no fake-tensor dispatch cache, no rewrite rule that cannot fire on a step
graph. Each leaves torch or onnxscript as it was when the library lacks what it sets (the export is then only slower).

The dispatch cache keys each op by its symbolic shapes, which the step graph's dynamic dimensions make a miss or a
costly hit; the rewrite rule SlicesSplit matches for long and never rewrites a step graph. What each cost:
docs/benchmarks/design-measurements.md."""

from __future__ import annotations

import contextlib
from unittest import mock


@contextlib.contextmanager
def lean_tracing():
    """For the time of one trace: the tracer records no Python stack per node (the exporter wrote each into its ONNX
    node's metadata: the paths of the checkout that built the engine, nothing a graph's reader uses; the module paths
    that builder/quantize/blockwise.py reads are recorded apart from them) and the fake-tensor mode keeps no dispatch
    cache."""
    import torch._dynamo.config as dynamo_config
    import torch.fx.config as fx_config

    with contextlib.ExitStack() as stack:
        if hasattr(fx_config, "do_not_emit_stack_traces"):
            stack.enter_context(mock.patch.object(fx_config, "do_not_emit_stack_traces", True))
        if hasattr(dynamo_config, "fake_tensor_cache_enabled"):
            stack.enter_context(mock.patch.object(dynamo_config, "fake_tensor_cache_enabled", False))
        yield


# Rules of onnxscript's default set that a step graph gives nothing to: the convolution, batch-norm and pad fusions
# (no such op in a decoder), and SlicesSplit (two Slices of the last axis into exact halves -> Split: RoPE's halves
# are sliced to the end (INT64_MAX), never to a constant size, so it does not match; where it would, two Slices
# compute what the Split does). Pattern matching them cost more than the rest of the rules together.
SKIPPED_RULES = frozenset(
    {
        "SlicesSplit",
        "NormalizePadFormatConv",
        "NormalizePadFormatConvInteger",
        "FuseConvPad",
        "FuseConvIntegerPad",
        "FuseBatchNormIntoConv",
        "FuseBatchNormIntoConvTranspose",
        "FuseBatchNormIntoGemm",
        "RemoveOptionalBiasFromConv",
        "RemoveOptionalBiasFromConvTranspose",
        "RemoveOptionalBiasFromQLinearConv",
    }
)


def optimize(model) -> None:
    """onnxscript's optimizer on the onnx_ir `model` (what the exporter's optimize() runs), in place, with its default
    rewrite rules but SKIPPED_RULES."""
    import onnxscript.optimizer
    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:  # another onnxscript
        onnxscript.optimizer.optimize_ir(model)
        return
    kept = tuple(rule for rule in rules if getattr(rule, "name", None) not in SKIPPED_RULES)
    with mock.patch.object(rewriter, "_DEFAULT_REWRITE_RULES", kept):
        onnxscript.optimizer.optimize_ir(model)
