"""Export a step module to ONNX (dynamo exporter, opset 18; int4 quantization moves a graph to 21), validate it
against torch with ONNX Runtime, and lint it.

The module's layout (builder/step.py) places the KV cache; the mode's outputs are its declaration (draft_outputs(),
state_specs()): export reads both and never runs or inspects the module to find them."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from specbuild import engine_format as ef
from specbuild.builder.step import HEAD_INPUTS, SAMPLING_INPUTS, StepModule
from specbuild.builder.torch_dtypes import TORCH_DTYPES
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
    probs = torch.softmax(torch.randn(batch, w, cfg.vocab_size, generator=g) * 3, dim=-1)  # drafts' q (unrelated)
    long_rope = (torch.arange(batch) + seed) % 2 == 1  # long factors on some rows (calls of other seeds: others)
    fixed, tail = step.arrange(
        head, step.kv_inputs(kv), [paths], sampling, [torch.zeros(min_rows, dtype=torch.bool)], states, [rows], [probs],
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
    fixed, tail = step.arrange(
        head, step.kv_dims(b, c), [paths], sampling, min_rows, states, rows, [{0: b, 1: w}], [{0: b}]
    )
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
        [ef.DRAFT_PROBS],
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
    step: StepModule, onnx_path: Path, weight=None, transform=None, log=None, before_write=None
) -> tuple[list, list]:
    """Export to `onnx_path` (+ external data file). Returns (input names, output names).

    weight(name): the value of each fake parameter of the network (a skeleton, builder/lazy_network.py) by its name
    there, read when the file is written, one at a time; transform(model): a pass over the exported onnx_ir model
    before it is written (weight quantization); before_write(): called once the trace is done, as the write starts
    (work that may run beside the write: TorchOutputsAhead.start)."""
    from specbuild.builder import ir_weights

    args = example_inputs(step, t=6, w=4, capacity=11, past=3, batch=2)  # room for a pad row
    inputs, outputs = io_names(step)
    for logger in ("torch.onnx", "onnx_ir", "onnxscript"):  # their passes log every initializer at INFO
        logging.getLogger(logger).setLevel(logging.ERROR)
    try:
        model = _export(step, args, inputs, outputs, weight, log)
    except SpecbuildError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecbuildError(f"ONNX export of the {step.plugin.name} step graph failed: {first[:300]}") from exc
    if transform is not None:
        transform(model)
    if before_write is not None:
        before_write()
    ir_weights.save(model, onnx_path, f"writing {onnx_path.name}", log=log)
    return inputs, outputs


def _export(step: StepModule, args, inputs: list[str], outputs: list[str], weight, log=None):
    """The exported, optimized onnx_ir model of `step`, its fake weights lazy; its trace taken from trace_cache when
    a module of the same structure was exported before."""
    import onnxscript.rewriter.onnx_fusions

    from specbuild.builder import cond_export, ir_weights, lean_export, lean_prepare, trace_cache

    dynamic = _dynamic_shapes(step)
    try:
        key = trace_cache.fingerprint(step, args, (OPSET, inputs, outputs, repr(dynamic)))
    except trace_cache.Uncacheable:
        key = None
    model = trace_cache.take(key, step) if key is not None else None
    with warnings.catch_warnings(), torch.no_grad():
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
        ir_weights.make_lazy(model, weight)
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


class DecisionMargins(torch.overrides.TorchFunctionMode):
    """The smallest margin of the discrete choices a torch computation makes: how far the values behind each choice
    were from choosing otherwise (argmax/argmin, max/min along a dim, topk, sort: the gap between the chosen and the
    next value; a comparison of floats: the smallest nonzero |a - b|). A choice whose margin is below the numerical
    difference of two implementations may come out either way in them."""

    SELECTIONS = {"argmax", "argmin", "max", "min", "topk", "sort", "argsort"}
    COMPARISONS = {"lt", "le", "gt", "ge", "__lt__", "__le__", "__gt__", "__ge__"}

    def __init__(self):
        super().__init__()
        self.margin = float("inf")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        try:
            if name in self.COMPARISONS:
                self._compared(*args[:2])
            elif name in self.SELECTIONS and args and isinstance(args[0], torch.Tensor):
                self._selected(name, args, kwargs)
        except (TypeError, RuntimeError, IndexError):  # a form these do not cover: no margin from it
            pass
        return out

    def _compared(self, a, b) -> None:
        if not any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in (a, b)):
            return
        gap = (torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs()
        gap = gap[gap > 0]
        if gap.numel():
            self.margin = min(self.margin, float(gap.min()))

    def _selected(self, name: str, args, kwargs) -> None:
        x = args[0]
        if not x.is_floating_point() or x.numel() < 2:
            return
        position = 2 if name == "topk" else 1  # where the dim argument sits
        default = None if name in ("argmax", "argmin", "max", "min") else -1
        dim = args[position] if len(args) > position else kwargs.get("dim", default)
        if name in ("max", "min") and (dim is None or isinstance(dim, torch.Tensor)):
            return  # the reduction to one value or the elementwise form: no choice of an index
        if name in ("argmax", "argmin") and dim is None:
            x, dim = x.reshape(-1), 0
        dim = int(dim) if not isinstance(dim, int) else dim
        count = x.shape[dim]
        if count < 2:
            return
        keep = count if name not in ("topk", "argmax", "argmin", "max", "min") else min(count, 2)
        if name == "topk":
            keep = min(count, int(kwargs.get("k", args[1])) + 1)
        ordered = torch.sort(x.double(), dim=dim, descending=True).values.narrow(dim, 0, keep)
        gaps = (ordered.narrow(dim, 0, keep - 1) - ordered.narrow(dim, 1, keep - 1)).abs()
        finite = gaps[torch.isfinite(gaps)]
        if finite.numel():
            self.margin = min(self.margin, float(finite.min()))


def decision_margin(step: StepModule, args) -> float:
    """The smallest margin of the discrete choices the torch step makes on one call (DecisionMargins)."""
    with torch.no_grad(), DecisionMargins() as margins:
        step(*args)
    return margins.margin


NEAR_TIE = 100  # a choice within this many times the call's float differences of another is a near-tie
NEAR_TIE_FLOOR = 1e-5  # ... and within at least this much


def check_calls(step: StepModule) -> list[tuple]:
    """The calls validate_export runs through both: (t, w, capacity, past, temperature, batch, draft rows).

    A prefill-like chain, a decode-like window, a padded one-token call, then two sequences of different lengths
    (greedy and sampled rows) in one call (trees of several sequences are checked end to end by the runtime's tests);
    a graph that drafts per row also drafts for the second row alone and for none."""
    calls = [(7, 1, 8, 0, 0.0, 1, None), (5, 5, 16, 6, 0.8, 1, None), (1, 1, 8, 4, 0.0, 1, None)]
    calls.append((2, 1, 12, 2, 0.8, 2, None))
    if step.selects_rows:
        calls += [(2, 2, 12, 2, 0.0, 2, [1]), (1, 1, 12, 2, 0.0, 2, [])]
    return calls


def _call_inputs(step: StepModule, call: tuple) -> tuple:
    t, w, cap, past, temp, batch, rows = call
    return example_inputs(step, t=t, w=w, capacity=cap, past=past, seed=t, temperature=temp, batch=batch,
                          draft_rows=rows)  # fmt: skip


def torch_outputs(step: StepModule, margins: bool = False) -> list[tuple[tuple, float | None]]:
    """Each of check_calls through the torch step: (its outputs in order, the margin of the choices it made where
    `margins`, else None: decision_margin's, from the same forward)."""
    results = []
    with torch.no_grad():
        for call in check_calls(step):
            args = _call_inputs(step, call)
            if not margins:
                results.append((tuple(step(*args)), None))
                continue
            with DecisionMargins() as seen:
                outputs = tuple(step(*args))
            results.append((outputs, seen.margin))
    return results


def _holding(step: StepModule, hold: int):
    """Within: a streamed reference keeps the weights it reads across its calls up to `hold` bytes
    (lazy_network.LazyNetwork.holding); they are dropped when it ends."""
    holding = getattr(step.net, "holding", None)
    return holding(hold) if holding is not None else contextlib.nullcontext()


class TorchOutputsAhead:
    """torch_outputs computed in a thread of its own from `start()` on (a large float graph's: while its file is
    written, which waits on the disk, so the reference's reads and calls take the time the write leaves), for
    validate_export to compare ONNX Runtime's outputs with. Its memory (the weights it holds) is given back before
    `result()` returns, so the graph's session never shares the machine with it."""

    def __init__(self, step: StepModule, hold: int):
        self._args, self._thread = (step, hold), None
        self._outcome: tuple | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specbuild-torch-reference", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step, hold = self._args
        try:
            with _holding(step, hold):  # the margins too: the weights are gone when a call's choices are looked at
                self._outcome = (True, torch_outputs(step, margins=True))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            self._outcome = (False, exc)
        finally:
            release_freed_memory()

    def result(self) -> list[tuple[tuple, float | None]]:
        if self._thread is None:
            self.start()
        self._thread.join()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim; a no-op elsewhere): weights a reference
    held and dropped would otherwise stay in the process's RSS beside the session loaded next."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def validate_export(
    step: StepModule,
    onnx_path: Path,
    tolerance: float,
    threads: int = 1,
    prepack: bool = True,
    hold: int = 0,
    reference: TorchOutputsAhead | None = None,
) -> dict:
    """Run torch and ONNX Runtime on a few calls (check_calls), one of them batched; return {max_abs_diff,
    near_ties}.

    Float outputs agree within `tolerance`; token outputs exactly, except in a call where torch made a choice at a
    near-tie (decision_margin below NEAR_TIE times the float differences of the call, or of the calls that agree where
    its float outputs diverged too): there the two may differ, and such a call is counted (near_ties), not refused.
    A fused graph runs with its KV buffers bound in place, as the runtime runs it, and its present buffers are
    compared whole (rows it must not touch included). prepack False:
    ONNX Runtime computes from the weights as stored (same float kernels, one copy of the weights in memory). hold:
    bytes of the weights a streamed torch reference (lazy_network.streamed) keeps across its calls once the session
    is gone (its size: the build's peak stays the graph's weights). reference: the torch outputs computed ahead
    (TorchOutputsAhead, its memory given back before the session loads); else they are computed after ONNX Runtime's.
    """
    import onnxruntime as ort

    from specbuild.runtime.backends.onnxruntime import run_bound

    expected = reference.result() if reference is not None else None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    aliases = aliased_outputs(names)
    # every call through ONNX Runtime, then the session dropped before torch runs them (unless it ran them ahead): a
    # large graph's weights and the torch reference's are never in memory together
    runs = []  # (call, its inputs, ONNX Runtime's outputs)
    for call in check_calls(step):
        args = _call_inputs(step, call)
        feeds = {n: (a.float() if a.dtype == torch.bfloat16 else a).numpy().copy() for n, a in zip(names, args)}
        got, _ = run_bound(sess, feeds, out_names, aliases)
        outputs = {name: np.array(got[name]) for name in out_names}  # owned: the session goes
        runs.append((call, args, outputs))
    del sess
    if expected is not None:
        return _compare_calls(step, runs, expected, out_names, tolerance)
    with _holding(step, hold):  # the near-ties' second look reads the held weights too
        return _compare_calls(step, runs, torch_outputs(step), out_names, tolerance)


def _compare_calls(step: StepModule, runs: list, expected: list, out_names: list[str], tolerance: float) -> dict:
    """validate_export's comparison: each call's torch outputs (`expected`: torch_outputs) against ONNX Runtime's."""
    worst = 0.0  # of the calls whose outputs agree
    near_ties, diverged = [], []
    for ((t, w, _, _, temp, batch, rows), args, got), (ref, margin) in zip(runs, expected):
        _check_declared_outputs(step, dict(zip(out_names, ref)), batch if rows is None else len(rows), w)
        differ, call_worst = [], 0.0
        for name, r in zip(out_names, ref):
            g = got[name]
            r = r.float().numpy() if r.is_floating_point() else r.numpy()
            if r.shape != g.shape:
                raise SpecbuildError(f"export validation: output {name} has shape {g.shape}, torch gives {r.shape}")
            if np.issubdtype(r.dtype, np.floating):
                call_worst = max(call_worst, float(np.max(np.abs(r - g.astype(np.float32)))) if r.size else 0.0)
            elif not np.array_equal(r, g):
                differ.append(name)
        if differ or call_worst > tolerance:
            diverged.append((args, margin, differ, call_worst, (t, w, temp, batch)))
        else:
            worst = max(worst, call_worst)
    # a call whose outputs diverged is a near-tie where torch made a choice there (a token, a tree node, a beam) closer
    # than NEAR_TIE times the float differences of the calls that agree: the other choice changes what follows it,
    # token outputs and the float states written for the chosen nodes alike
    for args, margin, differ, call_worst, call in diverged:
        margin = decision_margin(step, args) if margin is None else margin
        noise = call_worst if call_worst <= tolerance else worst
        if margin >= max(NEAR_TIE * noise, NEAR_TIE_FLOOR):
            if differ:
                raise SpecbuildError(
                    f"export validation: output {differ[0]} differs between torch and ONNX Runtime (the closest "
                    f"choice behind it was {margin:.3g} from another, float outputs differ by {call_worst:.3g})"
                )
            raise SpecbuildError(f"export validation: max abs diff {call_worst:.3g} exceeds {tolerance:g}")
        near_ties.append((*call, differ, margin))
    return {"max_abs_diff": worst, "near_ties": len(near_ties)}


def _check_declared_outputs(step: StepModule, outputs: dict, batch: int, window: int) -> None:
    """The mode's draft outputs have the dtype and shape its plugin declares (draft_outputs()); batch: the rows
    drafted for; window: the call's acceptance window (ef.WINDOW)."""
    for spec in step.plugin.draft_outputs():
        value = outputs[spec.name]
        shape = tuple({"B": batch, "W": window}.get(d, d) if isinstance(d, str) else d for d in spec.shape)
        if tuple(value.shape) != shape or value.dtype != TORCH_DTYPES[spec.dtype]:
            raise SpecbuildError(
                f"the {step.plugin.name} plugin declares {spec.name} {spec.dtype} {list(shape)}, its graph gives "
                f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
            )


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
    for value in sess.get_inputs():  # an int8 KV cache (builder/kv_int8.py): empty, as the call writes all it reads
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

    from specbuild.builder.trt_compat import assert_tensorrt_clean

    try:
        onnx.checker.check_model(str(onnx_path))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecbuildError(f"{onnx_path.name}: the ONNX checker refuses the exported graph: {first[:300]}") from None
    if tensorrt:
        assert_tensorrt_clean(onnx.load(str(onnx_path), load_external_data=False))
