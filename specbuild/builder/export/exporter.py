"""Export a step module to ONNX (dynamo exporter, opset 18; int4 quantization moves a graph to 21), compare a
quantized graph's logits with torch's, and lint it (builder/export/validation.py checks a graph call by call).

The module's layout (builder/network/step.py) places the KV cache; the mode's outputs are its declaration
(draft_outputs(), state_specs()): export reads both and never runs or inspects the module to find them."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.torch_dtypes import TORCH_DTYPES
from specbuild.builder.network.step import HEAD_INPUTS, SAMPLING_INPUTS, StepModule
from specbuild.errors import SpecbuildError

OPSET = 18
NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.float32,
    "int64": np.int64,
    "bool": np.bool_,
}


def example_inputs(
    step: StepModule,
    t: int,
    w: int,
    capacity: int,
    past: int,
    seed: int = 0,
    paths=None,
    tree_mask=None,
    temperature: float = 0.0,
    min_rows: int = 2,
    batch: int = 1,
    draft_rows=None,
):
    """Inputs for one call: per sequence a causal chain of t new tokens after its cached ones, in the step's order.
    Sequence b has past + b cached tokens (each row its own length), so capacity needs room for past + batch - 1 + t
    (+ min_rows - t spare slots after the tokens: the step padding of a row_padding graph). draft_rows: the rows
    drafted for (default every row)."""
    cfg = step.net.cfg
    dtype = step.net.norm.weight.dtype  # held in every network (a streamed one reads its embedding when asked)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=g)
    pasts = past + torch.arange(batch)
    position_ids = pasts.unsqueeze(1) + torch.arange(t).unsqueeze(0)
    if tree_mask is None:
        tree_mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).unsqueeze(0)
    tree_mask = tree_mask.expand(batch, t, t).clone()
    kv = torch.randn(cfg.num_layers, 2, batch, cfg.num_kv_heads, capacity, cfg.head_dim, generator=g).to(dtype)
    if paths is None:
        dp = min(3, w)
        paths = torch.full((1, 2, dp), -1, dtype=torch.int64)
        paths[0, 0, :dp] = torch.arange(t - w, t - w + dp)
        paths[0, 1, 0] = t - w
    paths = paths.expand(batch, *paths.shape[1:]).clone()
    states = []
    for spec in step.plugin.state_specs():
        shape = [{"B": batch, "C": capacity}.get(d, d) if isinstance(d, str) else d for d in spec.shape]
        if spec.dtype == "int64":
            states.append(torch.zeros(shape, dtype=torch.int64))
        elif spec.dtype == "bool":  # flags: mostly set, some not (EAGLE's draft_valid: positions a call skipped)
            states.append(torch.rand(shape, generator=g) < 0.75)
        else:
            states.append((torch.randn(shape, generator=g) * 0.5).to(TORCH_DTYPES[spec.dtype]))
    temperatures = torch.full((batch,), temperature, dtype=torch.float32)
    if batch > 1 and temperature > 0:
        temperatures[0] = 0.0  # a greedy row beside sampled ones
    sampling = [
        temperatures,
        torch.zeros(batch, dtype=torch.int64),
        torch.ones(batch, dtype=torch.float32),
        torch.rand(batch, w, generator=g),  # its width is the window W (ef.WINDOW)
        torch.rand(batch, generator=g),
    ]
    head = [input_ids, position_ids, tree_mask, pasts]
    rows = torch.arange(batch) if draft_rows is None else torch.as_tensor(draft_rows, dtype=torch.int64)
    long_rope = (torch.arange(batch) + seed) % 2 == 1  # long factors on some rows (calls of other seeds: others)
    fixed, tail = step.arrange(
        head, step.kv_inputs(kv), [paths], sampling, [torch.zeros(min_rows, dtype=torch.bool)], states, [rows],
        [long_rope],
    )  # fmt: skip
    return (*fixed, *tail)


def _dynamic_shapes(step: StepModule):
    dim = torch.export.Dim
    b = dim(ef.BATCH, min=1, max=ef.MAX_BATCH_SIZE)  # exported at batch 2: a batch-1 example would specialise it
    t = dim("new_tokens", min=1, max=65536)
    c = dim("capacity", min=1, max=1 << 20)
    w = dim(ef.WINDOW, min=1, max=4096)
    n_paths = dim("num_paths", min=1, max=4096)
    depth = dim("path_len", min=1, max=256)
    head = [{0: b, 1: t}, {0: b, 1: t}, {0: b, 1: t, 2: t}, {0: b}]
    sampling = [{0: b}, {0: b}, {0: b}, {0: b, 1: w}, {0: b}]
    paths = {0: b, 1: n_paths, 2: depth}
    states = [
        {i: {"B": b, "C": c}[d] for i, d in enumerate(s.shape) if isinstance(d, str)} for s in step.plugin.state_specs()
    ]
    min_rows = [{0: dim(ef.MIN_ROWS, min=1, max=64)}]
    rows = [{0: dim(ef.DRAFTED, min=0, max=ef.MAX_BATCH_SIZE)}]
    fixed, tail = step.arrange(head, step.kv_dims(b, c), [paths], sampling, min_rows, states, rows, [{0: b}])
    return (*fixed, tuple(tail)) if tail else tuple(fixed)  # the var-positional inputs: one entry


def io_names(step: StepModule) -> tuple[list[str], list[str]]:
    """(input names, output names) of the step graph, in order."""
    states = [ef.STATE_PREFIX + n for n in step.state_names]
    fixed, tail = step.arrange(
        HEAD_INPUTS,
        step.kv_input_names(),
        [ef.PATHS],
        SAMPLING_INPUTS,
        [ef.MIN_ROWS],
        states,
        [ef.DRAFT_ROWS],
        [ef.ROPE_LONG],
    )
    return fixed + tail, step.output_names()


def aliased_outputs(input_names: list[str]) -> dict[str, str]:
    """present output -> the past input it shares its buffer with (the fused graph's in-place KV cache)."""
    out = {}
    for name in input_names:
        for past, present in ((ef.PAST_KEY, ef.PRESENT_KEY), (ef.PAST_VALUE, ef.PRESENT_VALUE)):
            prefix = past.split("{")[0]
            if name.startswith(prefix) and name[len(prefix) :].isdigit():
                out[present.format(int(name[len(prefix) :]))] = name
    return out


def export_step(
    step: StepModule, onnx_path: Path, weight=None, transform=None, log=None, before_write=None, ahead=None
) -> tuple[list, list]:
    """Export to `onnx_path` (+ external data file). Returns (input names, output names).

    weight(name): the value of each fake parameter of the network (a skeleton, builder/network/lazy_network.py) by its
    name there, read when the file is written, one at a time; transform(model): a pass over the exported onnx_ir model
    before it is written (weight quantization); before_write(): called once the trace is done, as the write starts
    (work that may run beside the write: validation.TorchOutputsAhead.start); ahead: a weights_ahead.WeightsAhead
    for this file (no transform), started here, writing the weights while the graph is traced."""
    from specbuild.builder.export import ir_weights

    args = example_inputs(step, t=6, w=4, capacity=11, past=3, batch=2)  # room for a pad row
    inputs, outputs = io_names(step)
    for logger in ("torch.onnx", "onnx_ir", "onnxscript"):  # their passes log every initializer at INFO
        logging.getLogger(logger).setLevel(logging.ERROR)
    if ahead is not None:
        ahead.start()
    try:
        try:
            model = _export(step, args, inputs, outputs, weight, log, ahead)
        except SpecbuildError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecbuildError(f"ONNX export of the {step.plugin.name} step graph failed: {first[:300]}") from exc
        if transform is not None:
            transform(model)
        if before_write is not None:
            before_write()
        ir_weights.save(model, onnx_path, f"writing {onnx_path.name}", log=log, ahead=ahead)
    except BaseException:
        if ahead is not None:  # its writers stopped before the error is reported
            ahead.close()
        raise
    return inputs, outputs


def _export(step: StepModule, args, inputs: list[str], outputs: list[str], weight, log=None, ahead=None):
    """The exported, optimized onnx_ir model of `step`, its fake weights lazy; its trace taken from trace_cache when
    a module of the same structure was exported before."""
    import onnxscript.rewriter.onnx_fusions

    from specbuild import progress
    from specbuild.builder.export import cond_export, ir_weights, lean_export, lean_prepare, trace_cache

    dynamic = _dynamic_shapes(step)
    try:
        key = trace_cache.fingerprint(step, args, (OPSET, inputs, outputs, repr(dynamic)))
    except trace_cache.Uncacheable:
        key = None
    model = trace_cache.take(key, step) if key is not None else None
    traced = f"tracing and optimizing the {step.plugin.name} step graph"
    with warnings.catch_warnings(), torch.no_grad(), progress.waiting(traced, log):
        warnings.simplefilter("ignore")
        if model is None:
            # an If's branches checked from their graphs, and the program decomposed without a second trace, where
            # these show what torch's own passes would find
            with cond_export.lean_cond_passes(), lean_prepare.lean_preparation(), lean_export.lean_tracing():
                model = torch.onnx.export(
                    step,
                    args,
                    dynamo=True,
                    opset_version=OPSET,
                    input_names=inputs,
                    output_names=outputs,
                    dynamic_shapes=dynamic,
                    verbose=False,
                    optimize=False,  # once the fake parameters have their (lazy) values: below
                ).model
            stable_metadata(model)
            if key is not None:  # and taken back: the same model a later build of this structure gets
                trace_cache.keep(key, model, step)
                model = trace_cache.take(key, step) or model
        elif log is not None:
            log("reusing the exported graph of an earlier build of this structure (other weights: trace cache)")
        ir_weights.make_lazy(model, weight, ahead)
        lean_export.optimize(model)
        onnxscript.rewriter.onnx_fusions.fuse(model)
    return model


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def stable_metadata(model) -> None:
    """Drop the memory addresses torch's exporter writes into node metadata where a node comes from a Python function
    (`<function sym_min at 0x7f...>`): they differ in every process, so two builds of one engine (or a trace cached on
    disk and a fresh one) wrote different graph files."""
    import onnx_ir as ir

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for key, value in node.metadata_props.items():
            if " at 0x" in value:
                node.metadata_props[key] = _ADDRESS.sub(">", value)


def drop_unused_norm_statistics(onnx_path: Path) -> None:
    """Unname the optional mean / inverse-std outputs (1 and 2) of SkipSimplifiedLayerNormalization that nothing
    reads, so that ONNX Runtime neither computes nor allocates them (two small tensors per norm, 61 norms a step);
    the exporter names every output of a custom op. The weights (external data) are not touched."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    changed = False
    for node in graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == "com.microsoft":
            for index in (1, 2):
                if index < len(node.output) and node.output[index] and node.output[index] not in read:
                    node.output[index] = ""
                    changed = True
    if changed:
        onnx.save(model, str(onnx_path))


def compare_quantized(
    step: StepModule, onnx_path: Path, prompt_ids: list[int], accuracy_level: int, threads: int = 0
) -> dict:
    """How far a weight-quantized graph is from the (full-precision) torch step: one prefill of `prompt_ids` with
    the logits of every position (the graph must output logits). Returns the max and mean absolute logit error
    relative to the largest |logit|, and the share of positions whose argmax (the greedy next token) agrees."""
    want, have = prefill_logits(step, onnx_path, prompt_ids, accuracy_level, threads)
    scale = float(np.abs(want).max()) or 1.0
    error = np.abs(have - want)
    return {
        "max_logit_error": round(float(error.max()) / scale, 5),
        "mean_logit_error": round(float(error.mean()) / scale, 5),
        "top1_agreement": round(float((have.argmax(-1) == want.argmax(-1)).mean()), 4),
        "positions": len(prompt_ids),
    }


def prefill_logits(step: StepModule, onnx_path: Path, prompt_ids: list[int], accuracy_level: int, threads: int = 0):
    """(torch's, ONNX Runtime's) logits [T, V] of one prefill of `prompt_ids` through the step and the graph
    (threads 0: ONNX Runtime's default, every core)."""
    import onnxruntime as ort

    from specbuild.runtime.backends.onnxruntime import run_bound

    t = len(prompt_ids)
    args = list(example_inputs(step, t=t, w=t, capacity=t + 1, past=0, seed=1))  # + a pad row
    args[0] = torch.tensor([prompt_ids], dtype=torch.int64)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    feeds = {n: (a.float() if a.dtype == torch.bfloat16 else a).numpy().copy() for n, a in zip(names, args)}
    for (
        value
    ) in sess.get_inputs():  # an int8 KV cache (builder/quantize/kv_int8.py): empty, as the call writes all it reads
        if value.type == "tensor(int8)" and feeds[value.name].dtype != np.int8:
            feeds[value.name] = np.zeros(feeds[value.name].shape, dtype=np.int8)
    got, _ = run_bound(sess, feeds, out_names, aliased_outputs(names))
    del sess
    with torch.no_grad():
        ref = dict(zip(out_names, step(*args)))
    return ref[ef.LOGITS].float().numpy()[0], got[ef.LOGITS].astype(np.float32)[0]


def record_metadata(onnx_path: Path, entries: dict) -> int:
    """Add key/value entries to the graph file's metadata (ONNX Runtime reads them back without parsing the graph);
    return the graph's opset (of the default domain: 18, 21 with int4 weights), which engine.yaml records."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props} | {k: str(v) for k, v in entries.items()}
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(onnx_path))
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def drop_output(onnx_path: Path, name: str) -> None:
    """Remove graph output `name` (its value is still computed for the nodes that use it)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    keep = [o for o in model.graph.output if o.name != name]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    onnx.save(model, str(onnx_path))


def lint_graph(onnx_path: Path, tensorrt: bool) -> None:
    """Every graph passes ONNX's checker (well-formed graph, standard ops against their schemas, opset imports); the
    graph TensorRT parses also passes its parser's operator matrix (trt_compat)."""
    import onnx

    from specbuild.builder.export.trt_compat import assert_tensorrt_clean

    try:
        onnx.checker.check_model(str(onnx_path))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecbuildError(f"{onnx_path.name}: the ONNX checker refuses the exported graph: {first[:300]}") from None
    if tensorrt:
        assert_tensorrt_clean(onnx.load(str(onnx_path), load_external_data=False))
