"""Build one step graph of an engine: export, validate against torch, quantize, lint, record what it addresses.

Both graph kinds go through the same `GraphKind.build`; each says only what differs: `PortableGraph` (standard
ops, model.onnx, the KV cache stacked; TensorRT parses it, ONNX Runtime runs it too) and `FusedGraph` (ONNX
Runtime's fused CPU kernels, model.ort.onnx, in-place KV buffers per layer). `graph_kinds` picks which to build.
"""

from __future__ import annotations

from pathlib import Path

from specbuild import engine_format as ef
from specbuild.builder import export
from specbuild.builder.plan import BuildPlan
from specbuild.builder.step import FusedStepModule, StepModule


class GraphKind:
    """One kind of step graph: its file, KV layout and torch module, and the build every kind shares."""

    file: str
    kv_layout: str
    contrib_ops: bool  # may use ONNX Runtime's com.microsoft ops (the quantized embedding: GatherBlockQuantized)

    def module(self, plan: BuildPlan, net, plugin, output_logits: bool) -> StepModule:
        raise NotImplementedError

    def max_positions(self, plan: BuildPlan) -> int:
        """Positions the graph can address (kept in the graph file: the runtime checks engine.yaml against it)."""
        return plan.model.max_position_embeddings

    def after_export(self, onnx_path: Path) -> None:
        """Clean-up of the exported file that this kind needs."""

    def layout_entry(self, plan: BuildPlan) -> dict:
        """This kind's fields of the engine.yaml graph entry."""
        return {}

    def build(self, plan: BuildPlan, net, plugin, backends: list[str], directory: Path, log) -> dict:
        """Write the graph to directory/file; return its engine.yaml entry (for backends[0])."""
        import onnx

        from specbuild.builder.quantize import mode_nodes, quantize_step_graph

        step = self.module(plan, net, plugin, plan.options.output_logits or plan.quantized_bits is not None).eval()
        path = directory / self.file
        name = "/".join(backends)
        log(f"exporting {plan.mode} step graph for {name} ({plan.model.num_layers} layers, {plan.engine_dtype}) ...")
        export.export_step(step, path)
        self.after_export(path)
        diff = export.validate_export(step, path, plan.tolerance)
        log(f"{name} graph validated against torch: max abs diff {diff:.3g} (bound {plan.tolerance:g})")
        entry = {"validation": {"max_abs_diff": diff, "tolerance": plan.tolerance}}
        # MatMulNBits: in the graph that serves ONNX Runtime alone (the fused one, or the portable one where the
        # model's shape rules the fused kernels out and no tensorrt backend reads it: plan.resolve checks)
        heads = plan.head_weights if backends == [ef.BACKEND_ONNXRUNTIME] else None
        head_nodes = mode_nodes(onnx.load(str(path), load_external_data=False)) if heads else []
        if plan.quantized_bits is not None:
            entry["quantization"] = quantize_step_graph(step, path, plan, self.contrib_ops, name, log)
        if heads:
            entry["head_quantization"] = quantize_heads(path, head_nodes, heads, plan.options.weights_block_size, log)
        export.lint_graph(path, tensorrt=ef.BACKEND_TENSORRT in backends)
        opset = export.record_metadata(path, {ef.GRAPH_MAX_POSITIONS: self.max_positions(plan)})
        return {
            "role": ef.ROLE_TARGET,
            "backend": backends[0],
            "file": self.file,
            "kv_cache": self.kv_layout,
            "weights": plan.weights,
            "opset": opset,
            **entry,
            **self.layout_entry(plan),
        }


def quantize_heads(path: Path, head_nodes: list[str], weights: str, block_size: int, log) -> dict:
    """`--head-weights`: the mode's own matmuls of the graph at `path` in blocks; engine.yaml's head_quantization."""
    from specbuild.builder.quantize import quantize_mode_weights

    bits = ef.BLOCKWISE_BITS[weights]
    count = quantize_mode_weights(path, head_nodes, bits, block_size)
    log(f"heads: {count} matmuls of the mode's own in {weights} blocks of {block_size}, int8 activations")
    return {
        "bits": bits,
        "block_size": block_size,
        "symmetric": True,
        "accuracy_level": ef.ACCURACY_INT8,
        "matmuls": count,
    }


class PortableGraph(GraphKind):
    file = ef.ENGINE_ONNX
    kv_layout = ef.KV_STACKED
    contrib_ops = False

    def module(self, plan, net, plugin, output_logits):
        return StepModule(net, plugin, output_logits=output_logits, typical=plan.typical)


class FusedGraph(GraphKind):
    file = ef.ENGINE_ORT_ONNX
    kv_layout = ef.KV_SHARED
    contrib_ops = True

    def module(self, plan, net, plugin, output_logits):
        net.use_fused_kernels(plan.max_seq_len + plan.pad_rows)
        # the fused kernels' own settings: attention padding, step padding chosen at load (a min_rows input), and
        # their causal mask for chain drafts
        return FusedStepModule(
            net,
            plugin,
            output_logits=output_logits,
            typical=plan.typical,
            attention_pad=plan.pad_rows,
            row_padding=plan.pad_rows > 0,
            chain_drafts=plugin.chain_drafts(),
        )

    def max_positions(self, plan):
        return plan.max_seq_len + plan.pad_rows

    def after_export(self, onnx_path):
        export.drop_unused_norm_statistics(onnx_path)

    def layout_entry(self, plan):
        return {"attention_pad_rows": plan.pad_rows} if plan.pad_rows else {}


PORTABLE = PortableGraph()
FUSED = FusedGraph()


def graph_kinds(plan: BuildPlan, log) -> list[tuple[GraphKind, list[str]]]:
    """The graphs to build, portable first, each with the backends it serves (engine.yaml lists one entry each)."""
    portable = [b for b in (ef.BACKEND_TENSORRT,) if b in plan.options.backends]
    fused = [b for b in (ef.BACKEND_ONNXRUNTIME,) if b in plan.options.backends]
    if fused and plan.unfused:
        log(f"onnxruntime graph: the portable form ({plan.unfused})")
        portable, fused = portable + fused, []
    return [(kind, backends) for kind, backends in ((PORTABLE, portable), (FUSED, fused)) if backends]
