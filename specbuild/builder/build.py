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
from specbuild.runtime import kernels
from specbuild.runtime.integrity import remember_verified


def build_engine(checkpoint_dir, output_dir, options: BuildOptions, log=print) -> Path:
    """Build an engine directory. Nothing is left at output_dir if any step fails."""
    return build_plan(resolve(checkpoint_dir, output_dir, options), log)


def build_plan(plan: BuildPlan, log=print) -> Path:
    """Build the engine a resolved plan describes."""
    started = time.perf_counter()
    if plan.typical is not None:
        log("warning: typical acceptance is LOSSY (not distribution-preserving); the engine is marked lossless: false")
    if plan.checkpoint.dtype == "bfloat16" and plan.weights == "fp32":
        log("bfloat16 checkpoint: building a float32 engine (ONNX Runtime CPU has few bfloat16 kernels)")
    if plan.weights == "int8" and not plan.options.int8_activations:
        log(
            "note: --weights int8 with float activations: ONNX Runtime's CPU kernel dequantizes the 8-bit weights on "
            "every call (SmolLM2: 248 ms a token against 19 ms at fp32); --int8-activations runs them as int8"
        )
    elif slow_quantized_verification(plan):
        log(
            f"note: --weights {plan.weights} with float activations: ONNX Runtime's stock kernel computes a call of 2+ "
            "tokens by dequantizing every weight (SmolLM2: a 2-token call costs 2.6x a 1-token one), so speculation "
            f"rarely pays on it, and specbuild's own kernel, which keeps such calls cheap, is not available here "
            f"({kernels.description()}); --int8-activations keeps them cheaper on the stock kernels too"
        )
    if plan.head_weights_source:
        log(f"heads: {plan.head_weights or 'float'}: {plan.head_weights_source}")
    with atomic_output_dir(plan.target) as tmp:
        manifest = write_engine(plan, tmp, log, started)
    remember_verified(plan.target.path, manifest["checksums"])  # where the files now are: their first load
    log(f"engine written to {plan.target.shown} in {manifest['build_seconds']} s")
    return Path(plan.target.shown)


def slow_quantized_verification(plan: BuildPlan) -> bool:
    """A speculative ONNX Runtime engine with blockwise-quantized weights and float activations (MatMulNBits level 1
    dequantizes the weights for calls of two or more rows) where specbuild's own int4 kernel (runtime/kernels),
    which takes those matmuls at load, cannot be built."""
    return (
        plan.weights in ef.BLOCKWISE_WEIGHTS
        and not plan.options.int8_activations
        and not plan.spec.baseline
        and ef.BACKEND_ONNXRUNTIME in plan.options.backends
        and (plan.weights != "int4" or kernels.library() is None)
    )


def write_engine(plan: BuildPlan, directory: Path, log, started: float, net=None) -> dict:
    """Write the engine of `plan` into `directory` (its network `net`, default: the checkpoint's); the engines the
    mode builds beside it (a draft model's) go into subdirectories. Returns the manifest."""
    import numpy as np
    import torch

    from specbuild.builder.engine_manifest import write_manifest
    from specbuild.builder.export.weights_file import WEIGHTS_FILE, share_weights
    from specbuild.builder.graphs import graph_kinds
    from specbuild.builder.network import lazy_network

    torch.manual_seed(0)
    weight, reference = None, net
    if net is None:  # the checkpoint's network, never all in memory (builder/network/lazy_network.py)
        tensors, dtype = plan.checkpoint.tensors(), plan.engine_dtype
        net = lazy_network.skeleton(plan.model, tensors, dtype)
        reference = lazy_network.streamed(plan.model, tensors, dtype)
        weight = net.weight
        if plan.quantized_bits is None and plan.model.tie_word_embeddings:  # a quantized graph quantizes both
            net.tie_output()
            reference.tie_output()
    plugin = plan.plugin_cls(plan.checkpoint, net, plan.settings).to(net.embed_tokens.weight.dtype).eval()
    companions = []
    for subdir, sub_plan, sub_net, files in plugin.companion_engines(plan):
        log(f"building the {subdir} engine ({sub_plan.model.num_layers} layers, {sub_plan.weights}) ...")
        (directory / subdir).mkdir()
        sub = write_engine(sub_plan, directory / subdir, log, time.perf_counter(), sub_net)
        for name, array in files.items():
            np.save(directory / subdir / name, array, allow_pickle=False)
        companions += [{**g, "role": ef.ROLE_DRAFT, "file": f"{subdir}/{g['file']}"} for g in sub["graphs"]]
    graphs = []
    for kind, backends in graph_kinds(plan, log):
        entry = kind.build(plan, (net, reference, weight), plugin, backends, directory, log)
        graphs += [{**entry, "backend": backend} for backend in backends]
    stats = share_weights(directory, list(dict.fromkeys(g["file"] for g in graphs)))
    log(f"weights: {stats['bytes'] / 1e6:.1f} MB in {WEIGHTS_FILE} ({stats['shared']} tensors shared by graphs)")
    for graph in graphs:
        graph["io"] = _io_spec(directory / graph["file"])
    for name in (ef.TOKENIZER_FILE, ef.TOKENIZER_CONFIG_FILE):
        if (plan.checkpoint.path / name).is_file():
            shutil.copy(plan.checkpoint.path / name, directory / name)
    if plan.options.tensorrt:
        _compile_tensorrt_plan(plan, plugin, directory, log)
    seconds = round(time.perf_counter() - started, 1)
    return write_manifest(plan, plugin, graphs + companions, directory, seconds)


def _io_spec(onnx_path: Path) -> dict:
    """{"inputs": [...], "outputs": [...]}: name, dtype and shape (ints or symbolic names) as ONNX Runtime names them,
    read from the graph file alone (its weights are not loaded)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {i.name for i in graph.initializer}

    def describe(values):
        out = []
        for value in values:
            tensor = value.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
            out.append({"name": value.name, "dtype": ORT_TYPE_NAMES[tensor.elem_type], "shape": dims})
        return out

    return {"inputs": describe(i for i in graph.input if i.name not in weights), "outputs": describe(graph.output)}


# ONNX element types as ONNX Runtime names them ("tensor(float)" -> "float")
ORT_TYPE_NAMES = {1: "float", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
                  11: "double", 16: "bfloat16"}  # fmt: skip


def _compile_tensorrt_plan(plan: BuildPlan, plugin, directory: Path, log) -> None:
    from specbuild.builder.export.tensorrt_plan import build_tensorrt_plan, optimization_profiles

    log("compiling TensorRT plan ...")
    build_tensorrt_plan(
        directory / ef.ENGINE_ONNX,
        directory / ef.ENGINE_PLAN,
        fp16=plan.options.fp16_plan,
        profiles=optimization_profiles(
            plan.model, plugin, plan.max_seq_len, plan.options.max_batch_size, long_rope=plan.rope_switch is not None
        ),
    )
