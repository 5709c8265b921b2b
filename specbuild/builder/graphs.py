"""Build one step graph of an engine: export, validate against torch, quantize, lint, record what it addresses.

Both graph kinds go through the same `GraphKind.build`; each says only what differs: `PortableGraph` (standard
ops, model.onnx, the KV cache stacked; TensorRT parses it, ONNX Runtime runs it too) and `FusedGraph` (ONNX
Runtime's fused CPU kernels, model.ort.onnx, in-place KV buffers per layer). `graph_kinds` picks which to build.
"""

from __future__ import annotations

from pathlib import Path

from specbuild import engine_format as ef
from specbuild.builder.export import exporter, validation
from specbuild.builder.export.child_job import ChildJob
from specbuild.builder.network.step import FusedStepModule, StepModule
from specbuild.builder.plan import BuildPlan


class GraphKind:
    """One kind of step graph: its file, KV layout and torch module, and the build every kind shares."""

    file: str
    kv_layout: str
    contrib_ops: bool  # may use ONNX Runtime's com.microsoft ops (the quantized embedding: GatherBlockQuantized)

    def module(self, plan: BuildPlan, net, plugin, output_logits: bool) -> StepModule:
        """The step module of this kind over `net` (which takes ef.ROPE_LONG where the plan's sequences can grow past
        LongRoPE's switch)."""
        if plan.rope_switch is not None:
            net.use_long_rope()
        return self.step_module(plan, net, plugin, output_logits)

    def step_module(self, plan: BuildPlan, net, plugin, output_logits: bool) -> StepModule:
        raise NotImplementedError

    def max_positions(self, plan: BuildPlan) -> int:
        """Positions the graph can address (kept in the graph file: the runtime checks engine.yaml against it)."""
        return plan.model.max_position_embeddings

    def after_export(self, onnx_path: Path) -> None:
        """Clean-up of the exported file that this kind needs."""

    def kv_quantizer(self, plan: BuildPlan, reference, log):
        """(transform, engine.yaml entry) that gives the graph a quantized KV cache (--kv-cache), or (None, None)."""
        return None, None

    def layout_entry(self, plan: BuildPlan) -> dict:
        """This kind's fields of the engine.yaml graph entry."""
        return {}

    def build(self, plan: BuildPlan, nets: tuple, plugin, backends: list[str], directory: Path, log) -> dict:
        """Write the graph to directory/file; return its engine.yaml entry (for backends[0]).

        nets: (the network to export, the torch reference to check against, weight(name) for the exported network's
        fake parameters or None): builder/network/lazy_network.py. A graph whose float weights are small is exported,
        checked call by call against torch (validate_export) and then quantized. So is a float graph of any size (its
        reference reads each layer from the checkpoint as it runs). A large quantized one is checked call by call on
        a truncated float network (its first TRUNCATED_LAYERS layers) and written quantized at once, its weights made
        one at a time, then compared whole with torch on a prompt (quantize_step_graph); the truncated network is
        checked in a child process while this one exports and writes the graph (builder/export/child_job.py)."""
        from specbuild.builder.quantize.blockwise import quantize_step_graph

        net, reference, weight = nets
        path, name = directory / self.file, "/".join(backends)
        # MatMulNBits heads: in the graph that serves ONNX Runtime alone (the fused one, or the portable one where the
        # model's shape rules the fused kernels out and no tensorrt backend reads it: plan.resolve checks)
        heads = plan.head_weights if backends == [ef.BACKEND_ONNXRUNTIME] else None
        small = float_weight_bytes(plan) <= SMALL_GRAPH_BYTES
        whole = small or plan.quantized_bits is None  # a float graph of any size is checked call by call itself
        quantize_kv, kv_entry = self.kv_quantizer(plan, reference, log)
        # the quantized checks read them
        logits = plan.options.output_logits or plan.quantized_bits is not None or quantize_kv is not None
        step = self.module(plan, net, plugin, logits).eval()
        check = step if reference is net else self.module(plan, reference, plugin, logits).eval()
        counts: dict[str, int] = {}
        quantize = _quantizer(plan, heads, self.contrib_ops, counts)
        log(f"exporting {plan.mode} step graph for {name} ({plan.model.num_layers} layers, {plan.engine_dtype}) ...")
        if whole:
            large = {} if small else large_validation(float_weight_bytes(plan))
            diff = self.export_validated(step, check, path, weight, plan.tolerance, large, log)
            if quantize is not None:
                rewrite_graph(path, quantize, log)
        else:  # the truncated network's trace and checks on the second core while this one writes the graph
            with ChildJob("checking the truncated network", self.validate_truncated, plan, directory,
                          TRUNCATED_LAYERS) as truncated:  # fmt: skip
                exporter.export_step(step, path, weight=weight, transform=quantize, log=log)
                self.after_export(path)
                diff = truncated.result()
        if quantize_kv is not None:
            quantize_kv(path)
        what = "graph" if whole else f"graph's first {TRUNCATED_LAYERS} layers"
        ties = f", {diff['near_ties']} call(s) with a choice at a near-tie" if diff["near_ties"] else ""
        log(f"{name} {what} validated against torch: max abs diff {diff['max_abs_diff']:.3g} (bound "
            f"{plan.tolerance:g}){ties}")  # fmt: skip
        entry = {"validation": {**diff, "tolerance": plan.tolerance}}
        if not whole:
            entry["validation"]["layers"] = TRUNCATED_LAYERS
        if plan.quantized_bits is not None:
            entry["quantization"] = quantize_step_graph(check, path, plan, name, log)
        if quantize_kv is not None:
            entry[ef.GRAPH_KV_CACHE_DTYPE] = ef.KV_CACHE_INT8
            entry["kv_quantization"] = {**kv_entry, **kv_cache_check(check, path, plan, entry.get("quantization"), log)}
        if heads:
            entry["head_quantization"] = _head_entry(heads, plan.options.weights_block_size, counts["heads"], log)
        exporter.lint_graph(path, tensorrt=ef.BACKEND_TENSORRT in backends)
        opset = exporter.record_metadata(path, {ef.GRAPH_MAX_POSITIONS: self.max_positions(plan)})
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

    def validate_truncated(self, plan: BuildPlan, directory: Path, layers: int) -> dict:
        """validate_export on the network's first `layers` layers (float, the mode's heads with it; capture layers
        beyond them read the last): every kind of call, discrete outputs exact but at near-ties."""
        import dataclasses
        import tempfile

        from specbuild.builder.checkpoint.torch_dtypes import FLOAT_DTYPES
        from specbuild.builder.checkpoint.weights_io import LazyTensors
        from specbuild.builder.network import lazy_network

        ckpt = dataclasses.replace(plan.checkpoint, model=dataclasses.replace(plan.model, num_layers=layers))
        tensors = plan.checkpoint.tensors()
        kept = [n for n in tensors if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers]
        kept = tensors.subset(kept) if isinstance(tensors, LazyTensors) else {n: tensors[n] for n in kept}
        # exported and checked as the whole graph is: a skeleton whose weights are made as the graph is written,
        # against a reference that reads each weight from the checkpoint when it runs (at 8B the embedding and the
        # lm_head alone are 4 GB in float32)
        net = lazy_network.skeleton(ckpt.model, kept, plan.engine_dtype)
        reference = lazy_network.streamed(ckpt.model, kept, plan.engine_dtype)
        if ckpt.model.tie_word_embeddings:  # a float graph: its tied lm_head stored once, as a float engine's is
            net.tie_output()
            reference.tie_output()
        plugin = plan.plugin_cls(ckpt, net, plan.settings).to(FLOAT_DTYPES[plan.engine_dtype]).eval()
        plugin.capture_layers = tuple(min(int(i), layers) for i in plugin.capture_layers)
        truncated = dataclasses.replace(plan, checkpoint=ckpt)
        step, check = (self.module(truncated, n, plugin, False).eval() for n in (net, reference))
        with tempfile.TemporaryDirectory(prefix=".truncated-", dir=directory) as tmp:
            large = large_validation(float_bytes(kept, plan))
            return self.export_validated(step, check, Path(tmp) / self.file, net.weight, plan.tolerance, large)

    def export_validated(self, step, check, path: Path, weight, tolerance: float, large: dict, log=None) -> dict:
        """Export `step` to `path` and validate it against torch's `check` (validate_export): where its weights come
        from a checkpoint (`weight`), they are written while the graph is traced and the reference reads them from
        the file (builder/export/weights_ahead.py); a large graph's reference (`large`: large_validation's settings)
        runs its calls while the rest of the file is written, then the graph on every core, from its weights as
        stored."""
        from specbuild.builder.export import weights_ahead

        large = dict(large)
        hold = large.pop("hold", 0)  # of what the reference reads from the checkpoint (not what `ahead` wrote)
        ahead = weights_ahead.WeightsAhead(step, path, weight) if weight is not None else None
        with weights_ahead.reading(check, ahead):
            reference = validation.TorchOutputsAhead(check, hold, log) if large else None
            exporter.export_step(step, path, weight=weight, log=log, before_write=reference and reference.start,
                               ahead=ahead)  # fmt: skip
            self.after_export(path)
            return validation.validate_export(check, path, tolerance, reference=reference, log=log, **large)


SEGMENT_BYTES = 1024**3  # of weights a large graph's validation runs in one session (graph_segments.py)
HELD_SHARE = 0.75  # of a large graph's weights its torch reference keeps across the validation's calls


def large_validation(weight_bytes: int) -> dict:
    """validate_export's settings for a large graph of `weight_bytes` float weights: every core, ONNX Runtime
    computing from the weights as stored (one copy of them in memory), and how much of what a torch reference reads
    from the checkpoint it keeps across its calls (reading and converting them again cost more than the calls; what
    it reads from the graph's own file it keeps not: views of it cost nothing to make again), and the graph run in
    segments of SEGMENT_BYTES of weights, one session at a time (validation.run_graph): a check of the whole graph
    holds about one segment's weights."""
    return dict(threads=0, prepack=False, hold=int(HELD_SHARE * weight_bytes), segment_bytes=SEGMENT_BYTES)


TRUNCATED_LAYERS = 2  # layers of the network a large graph is validated on call by call (layer 0 and a later one)
SMALL_GRAPH_BYTES = 2 * 1024**3  # float weights up to which a graph is exported, validated and quantized whole


def float_weight_bytes(plan: BuildPlan) -> int:
    """The base network's weights in the engine's float dtype (what a float graph of it holds)."""
    return float_bytes(plan.checkpoint.tensors(), plan)


def float_bytes(tensors, plan: BuildPlan) -> int:
    """The bytes of checkpoint `tensors` in the engine's float dtype."""
    from specbuild.builder.checkpoint.weights_io import spec_of

    size = 2 if plan.engine_dtype == "float16" else 4
    total = 0
    for name in tensors:
        shape, _ = spec_of(tensors, name)
        count = 1
        for dim in shape:
            count *= int(dim)
        total += count * size
    return total


def _quantizer(plan: BuildPlan, heads: str | None, fused_gather: bool, counts: dict):
    """The pass that quantizes a graph's weights (--weights int4/int8, --head-weights), or None; it records the
    matmuls it quantized in `counts`."""
    from specbuild.builder.quantize.blockwise import (
        ACCURACY_FP32,
        ACCURACY_INT8,
        mode_nodes,
        name_nodes_uniquely,
        quantize_base,
        quantize_heads,
    )

    if plan.quantized_bits is None and not heads:
        return None
    block = plan.options.weights_block_size
    level = ACCURACY_INT8 if plan.options.int8_activations else ACCURACY_FP32

    def quantize(model) -> None:
        name_nodes_uniquely(model)  # the passes select nodes by name, those of If branches too
        own = mode_nodes(model)  # before the opset conversion
        if plan.quantized_bits is not None:
            counts["base"] = quantize_base(model, plan.quantized_bits, block, level, fused_gather)
        if heads:
            counts["heads"] = quantize_heads(model, own, ef.BLOCKWISE_BITS[heads], block)

    return quantize


def kv_cache_check(check, path: Path, plan: BuildPlan, quantization: dict | None, log) -> dict:
    """How far the int8-cache graph at `path` is from the float torch step on a sample text (the weights'
    quantization check measured both where the weights are quantized too; its logits output is then gone)."""
    from specbuild.builder.export.exporter import compare_quantized, drop_output
    from specbuild.builder.quantize.blockwise import ACCURACY_FP32, sample_prompt

    if quantization is not None:
        measured = {k: quantization[k] for k in ("max_logit_error", "mean_logit_error", "top1_agreement", "positions")}
        return {**measured, "measured_with": f"{plan.weights} weights"}
    measured = compare_quantized(check, path, sample_prompt(plan.checkpoint), accuracy_level=ACCURACY_FP32)
    log(
        f"KV cache int8 graph against torch's float cache: top-1 agreement {measured['top1_agreement']:.1%} over "
        f"{measured['positions']} positions, logit error max {measured['max_logit_error']:.3f} mean "
        f"{measured['mean_logit_error']:.4f} (relative)"
    )
    if not plan.options.output_logits:
        drop_output(path, ef.LOGITS)
    return measured


def rewrite_graph(path: Path, transform, log) -> None:
    """Apply `transform` to the graph at `path` (its weights read from its data file as they are written) and write
    it back: staged beside it, swapped in, data files nothing reads any more removed."""
    import onnx_ir as ir

    from specbuild.builder.export import ir_weights

    model = ir.load(path)
    transform(model)
    staged = path.with_name(f"quantized.{path.name}")
    before = set(_data_files(path))
    ir_weights.save(model, staged, f"writing {path.name}", log=log)
    del model
    staged.replace(path)
    for name in before - set(_data_files(path)):
        (path.parent / name).unlink(missing_ok=True)


def _data_files(path: Path) -> list[str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [e.value for i in model.graph.initializer for e in i.external_data if e.key == "location"]


def _head_entry(weights: str, block_size: int, count: int, log) -> dict:
    """engine.yaml's head_quantization of `--head-weights`: the mode's own matmuls in blocks."""
    log(f"heads: {count} matmuls of the mode's own in {weights} blocks of {block_size}, int8 activations")
    return {
        "bits": ef.BLOCKWISE_BITS[weights],
        "block_size": block_size,
        "symmetric": True,
        "accuracy_level": ef.ACCURACY_INT8,
        "matmuls": count,
    }


class PortableGraph(GraphKind):
    file = ef.ENGINE_ONNX
    kv_layout = ef.KV_STACKED
    contrib_ops = False

    def step_module(self, plan, net, plugin, output_logits):
        return StepModule(net, plugin, output_logits=output_logits, typical=plan.typical)


class FusedGraph(GraphKind):
    file = ef.ENGINE_ORT_ONNX
    kv_layout = ef.KV_SHARED
    contrib_ops = True

    def step_module(self, plan, net, plugin, output_logits):
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
        exporter.drop_unused_norm_statistics(onnx_path)

    def kv_quantizer(self, plan, reference, log):
        from specbuild.builder.quantize import kv_int8

        return kv_int8.kv_quantizer(plan, reference, log)

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
