"""Export the step module to ONNX (dynamo exporter, opset 18) and validate it against torch with ONNX Runtime."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from specbuild import engine_format as ef
from specbuild.builder.step import BASE_INPUTS, BASE_OUTPUTS, StepModule
from specbuild.errors import SpecbuildError

OPSET = 18
NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.float32,
    "int64": np.int64,
    "bool": np.bool_,
}
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
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
):
    """Inputs for one call: a causal chain of t new tokens after `past` cached ones (batch 1)."""
    cfg = step.net.cfg
    dtype = step.net.embed_tokens.weight.dtype
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (1, t), generator=g)
    position_ids = (past + torch.arange(t)).unsqueeze(0)
    if tree_mask is None:
        tree_mask = torch.tril(torch.ones(t, t, dtype=torch.bool)).unsqueeze(0)
    kv = torch.randn(cfg.num_layers, 2, 1, cfg.num_kv_heads, capacity, cfg.head_dim, generator=g).to(dtype)
    if paths is None:
        dp = min(3, w)
        paths = torch.full((1, 2, dp), -1, dtype=torch.int64)
        paths[0, 0, :dp] = torch.arange(t - w, t - w + dp)
        paths[0, 1, 0] = t - w
    states = []
    for spec in step.plugin.state_specs():
        shape = [{"B": 1, "C": capacity}.get(d, d) if isinstance(d, str) else d for d in spec.shape]
        if spec.dtype == "int64":
            states.append(torch.zeros(shape, dtype=torch.int64))
        else:
            states.append((torch.randn(shape, generator=g) * 0.5).to(TORCH_DTYPES[spec.dtype]))
    return (
        input_ids,
        position_ids,
        tree_mask,
        torch.tensor([past]),
        kv,
        paths,
        torch.tensor([temperature], dtype=torch.float32),
        torch.tensor([0]),
        torch.tensor([1.0], dtype=torch.float32),
        torch.rand(1, w, generator=g),
        torch.rand(1, generator=g),
        *states,
    )


def _dynamic_shapes(step: StepModule):
    dim = torch.export.Dim
    # The step graph is batch 1 (limits.max_batch_size): a dynamic batch Dim makes torch.export fail on the
    # specialisation and export a second time with it fixed, doubling the export time for the same graph.
    b = 1
    t = dim("new_tokens", min=1, max=65536)
    c = dim("capacity", min=1, max=1 << 20)
    w = dim("window", min=1, max=4096)
    n_paths = dim("num_paths", min=1, max=4096)
    depth = dim("path_len", min=1, max=256)
    base = (
        {0: b, 1: t},
        {0: b, 1: t},
        {0: b, 1: t, 2: t},
        {0: b},
        {2: b, 4: c},
        {0: b, 1: n_paths, 2: depth},
        {0: b},
        {0: b},
        {0: b},
        {0: b, 1: w},
        {0: b},
    )
    states = []
    for spec in step.plugin.state_specs():
        states.append({i: {"B": b, "C": c}[d] for i, d in enumerate(spec.shape) if isinstance(d, str)})
    return base + ((tuple(states),) if states else ())  # *states is one var-positional entry


def io_names(step: StepModule) -> tuple[list[str], list[str]]:
    inputs = BASE_INPUTS + [ef.STATE_PREFIX + n for n in step.state_names]
    outputs = BASE_OUTPUTS + step.draft_output_names + ([ef.LOGITS] if step.output_logits else [])
    return inputs, outputs


def export_step(step: StepModule, onnx_path: Path) -> tuple[list[str], list[str]]:
    """Export to `onnx_path` (+ external data file). Returns (input names, output names)."""
    args = example_inputs(step, t=6, w=4, capacity=9, past=3)
    with torch.no_grad():
        step(*args)  # records the plugin's output names
    inputs, outputs = io_names(step)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                step,
                args,
                dynamo=True,
                opset_version=OPSET,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=_dynamic_shapes(step),
                verbose=False,
                optimize=True,
            )
            program.save(str(onnx_path), external_data=True)
    except SpecbuildError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecbuildError(f"ONNX export of the {step.plugin.name} step graph failed: {first[:300]}") from exc
    return inputs, outputs


def validate_export(step: StepModule, onnx_path: Path, tolerance: float, threads: int = 1) -> float:
    """Run torch and ONNX Runtime on two calls (prefill-like chain, decode-like window); return the max abs diff.

    Token outputs must agree exactly; float outputs within `tolerance`.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    worst = 0.0
    for t, w, cap, past, temp in ((7, 1, 8, 0, 0.0), (5, 5, 16, 6, 0.8)):
        args = example_inputs(step, t=t, w=w, capacity=cap, past=past, seed=t, temperature=temp)
        with torch.no_grad():
            ref = step(*args)
        feeds = {n: a.float().numpy() if a.dtype == torch.bfloat16 else a.numpy() for n, a in zip(names, args)}
        got = sess.run(None, feeds)
        for name, r, g in zip(out_names, ref, got):
            r = r.float().numpy() if r.is_floating_point() else r.numpy()
            if r.shape != g.shape:
                raise SpecbuildError(f"export validation: output {name} has shape {g.shape}, torch gives {r.shape}")
            if np.issubdtype(r.dtype, np.floating):
                worst = max(worst, float(np.max(np.abs(r - g.astype(np.float32)))) if r.size else 0.0)
            elif not np.array_equal(r, g):
                raise SpecbuildError(f"export validation: output {name} differs between torch and ONNX Runtime")
    if worst > tolerance:
        raise SpecbuildError(f"export validation: max abs diff {worst:.3g} exceeds {tolerance:g}")
    return worst
