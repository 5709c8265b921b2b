"""`specbuild build`: resolve a plan, build each step graph, write the manifest (and the TensorRT plan if asked).

resolve (plan.py) checks everything before any work; each graph kind (graphs.py) exports, validates, quantizes and
lints its graph; engine_manifest.py writes engine.yaml from the plan and the graph entries.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from specbuild import engine_format as ef
from specbuild.builder.options import BuildOptions
from specbuild.builder.plan import BuildPlan, resolve
from specbuild.fsutil import atomic_output_dir


def build_engine(checkpoint_dir, output_dir, options: BuildOptions, log=print) -> Path:
    """Build an engine directory. Nothing is left at output_dir if any step fails."""
    return build_plan(resolve(checkpoint_dir, output_dir, options), log)


def build_plan(plan: BuildPlan, log=print) -> Path:
    """Build the engine a resolved plan describes."""
    import torch

    from specbuild.builder.engine_manifest import write_manifest
    from specbuild.builder.graphs import graph_kinds
    from specbuild.builder.network import LlamaNetwork
    from specbuild.builder.weights_file import WEIGHTS_FILE, share_weights

    started = time.perf_counter()
    if plan.typical is not None:
        log("warning: typical acceptance is LOSSY (not distribution-preserving); the engine is marked lossless: false")
    if plan.checkpoint.dtype == "bfloat16" and plan.weights == "fp32":
        log("bfloat16 checkpoint: building a float32 engine (ONNX Runtime CPU has few bfloat16 kernels)")
    torch.manual_seed(0)
    net = LlamaNetwork.from_tensors(plan.model, plan.checkpoint.tensors(), plan.engine_dtype)
    plugin = plan.plugin_cls(plan.checkpoint, net, plan.settings).to(net.embed_tokens.weight.dtype).eval()
    with atomic_output_dir(plan.target) as tmp:
        graphs = []
        for kind, backends in graph_kinds(plan, log):
            entry = kind.build(plan, net, plugin, backends, tmp, log)
            graphs += [{**entry, "backend": backend} for backend in backends]
        stats = share_weights(tmp, list(dict.fromkeys(g["file"] for g in graphs)))
        log(f"weights: {stats['bytes'] / 1e6:.1f} MB in {WEIGHTS_FILE} ({stats['shared']} tensors shared by graphs)")
        for graph in graphs:
            graph["io"] = _io_spec(tmp / graph["file"])
        for name in (ef.TOKENIZER_FILE, ef.TOKENIZER_CONFIG_FILE):
            if (plan.checkpoint.path / name).is_file():
                shutil.copy(plan.checkpoint.path / name, tmp / name)
        if plan.options.tensorrt:
            _compile_tensorrt_plan(plan, plugin, tmp, log)
        manifest = write_manifest(plan, plugin, graphs, tmp, round(time.perf_counter() - started, 1))
    log(f"engine written to {plan.target.shown} in {manifest['build_seconds']} s")
    return Path(plan.target.shown)


def _io_spec(onnx_path: Path) -> dict:
    """{"inputs": [...], "outputs": [...]}: name, dtype and shape (ints or symbolic names) as ONNX Runtime sees them."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])

    def describe(items):
        return [
            {"name": i.name, "dtype": i.type.removeprefix("tensor(").rstrip(")"), "shape": list(i.shape)} for i in items
        ]

    return {"inputs": describe(sess.get_inputs()), "outputs": describe(sess.get_outputs())}


def _compile_tensorrt_plan(plan: BuildPlan, plugin, directory: Path, log) -> None:
    from specbuild.builder.tensorrt_plan import build_tensorrt_plan, optimization_profiles

    log("compiling TensorRT plan ...")
    build_tensorrt_plan(
        directory / ef.ENGINE_ONNX,
        directory / ef.ENGINE_PLAN,
        fp16=plan.options.fp16_plan,
        profiles=optimization_profiles(plan.model, plugin, plan.max_seq_len, plan.options.max_batch_size),
    )
