"""Validation of an exported step graph against torch: the same calls through ONNX Runtime and the torch step
(`check_calls`, one of them batched), float outputs within a tolerance, token outputs exactly unless torch chose at
a near-tie (`DecisionMargins`: counted, not refused).

A large float graph's torch reference runs its calls while the graph file is written (`TorchOutputsAhead`, the
write waiting on the disk), and gives its memory back before the graph's session loads."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from pathlib import Path

import numpy as np
import torch

from specbuild.builder.checkpoint.torch_dtypes import TORCH_DTYPES
from specbuild.builder.export.exporter import aliased_outputs, example_inputs
from specbuild.builder.network.step import StepModule
from specbuild.errors import SpecbuildError
from specbuild.progress import steps


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


def torch_outputs(step: StepModule, margins: bool = False, log=None) -> list[tuple[tuple, float | None]]:
    """Each of check_calls through the torch step: (its outputs in order, the margin of the choices it made where
    `margins`, else None: decision_margin's, from the same forward). log: where its progress lines go (a call of a
    large network takes seconds), else none."""
    results = []
    calls = check_calls(step)
    with torch.no_grad(), steps("the torch reference's calls", len(calls), enabled=log is not None, log=log) as done:
        for call in calls:
            args = _call_inputs(step, call)
            if not margins:
                results.append((tuple(step(*args)), None))
            else:
                with DecisionMargins() as seen:
                    outputs = tuple(step(*args))
                results.append((outputs, seen.margin))
            done()
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

    def __init__(self, step: StepModule, hold: int, log=None):
        self._args, self._thread, self._log = (step, hold), None, log
        self._outcome: tuple | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specbuild-torch-reference", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step, hold = self._args
        try:
            with _holding(step, hold):  # the margins too: the weights are gone when a call's choices are looked at
                self._outcome = (True, torch_outputs(step, margins=True, log=self._log))
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
    reference: TorchOutputsAhead | None = None,
    segment_bytes: int | None = None,
    log=None,
) -> dict:
    """Run torch and ONNX Runtime on a few calls (check_calls), one of them batched; return {max_abs_diff,
    near_ties}.

    Float outputs agree within `tolerance`; token outputs exactly, except in a call where torch made a choice at a
    near-tie (decision_margin below NEAR_TIE times the float differences of the call, or of the calls that agree where
    its float outputs diverged too): there the two may differ, and such a call is counted (near_ties), not refused.
    A fused graph runs with its KV buffers bound in place, as the runtime runs it, and its present buffers are
    compared whole (rows it must not touch included). prepack False:
    ONNX Runtime computes from the weights as stored (same float kernels, one copy of the weights in memory).
    reference: the torch outputs computed ahead (TorchOutputsAhead, which keeps what its streamed reference reads
    within a budget and gives it back before the session loads); else they are computed after ONNX Runtime's.
    segment_bytes: a graph whose weights pass it runs in segments of about that many bytes of weights, one session
    at a time (run_graph), reported through `log`.
    """
    import onnxruntime as ort

    expected = reference.result() if reference is not None else None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    names, out_names = graph_io_names(onnx_path)
    calls = check_calls(step)
    args = [_call_inputs(step, call) for call in calls]
    feeds = [{n: (a.float() if a.dtype == torch.bfloat16 else a).numpy().copy() for n, a in zip(names, call_args)}
             for call_args in args]  # fmt: skip
    # every call through ONNX Runtime, then its sessions dropped before torch runs them (unless it ran them ahead): a
    # large graph's weights and the torch reference's are never in memory together
    outputs = run_graph(onnx_path, feeds, out_names, aliased_outputs(names), opts, segment_bytes, log)
    runs = list(zip(calls, args, outputs))  # (call, its inputs, ONNX Runtime's outputs)
    if expected is not None:
        return _compare_calls(step, runs, expected, out_names, tolerance)
    return _compare_calls(step, runs, torch_outputs(step), out_names, tolerance)


def graph_io_names(onnx_path: Path) -> tuple[list[str], list[str]]:
    """The graph's input names (as its session lists them: initializers excluded) and output names, in order."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    return [i.name for i in graph.input if i.name not in weights], [o.name for o in graph.output]


def run_graph(onnx_path: Path, feeds: list[dict], out_names: list[str], aliases: dict[str, str], opts,
              segment_bytes: int | None = None, log=None) -> list[dict]:  # fmt: skip
    """Each call's `feeds` through the graph (its KV buffers bound in place: `aliases`); each call's outputs, owned.
    segment_bytes: run a graph whose weights pass it in segments of about that many bytes of weights, one session
    at a time (graph_segments.py), so that its weights are never all in memory at once."""
    import onnxruntime as ort

    from specbuild.builder.export import graph_segments
    from specbuild.runtime.backends.onnxruntime import run_bound

    def run_segment(path: Path, calls: list[dict], wanted: list[str]) -> list[dict]:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        results = []
        for call in calls:
            own = {o: i for o, i in aliases.items() if o in wanted and i in call}
            got, _ = run_bound(sess, call, wanted, own)
            # an in-place output is its input's buffer (a later segment reads it); the others owned: the session goes
            results.append({n: got[n] if n in own else np.array(got[n]) for n in wanted})
        del sess
        release_freed_memory()
        return results

    values = None
    if segment_bytes is not None:
        values = graph_segments.run_segmented(onnx_path, feeds, segment_bytes, run_segment, log)
    if values is None:
        return run_segment(onnx_path, feeds, out_names)
    return [{n: np.array(v[n]) for n in out_names} for v in values]


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
