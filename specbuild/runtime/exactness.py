"""What an engine can promise on the machine that runs it, decided when it loads.

engine.yaml's `lossless` is what the build can promise; with int8 activations or an int8 KV cache it also rests on
the CPU's kernels (runtime/row_invariance.py). At load:
- float activations and a float cache (and the TensorRT plan): nothing depends on the CPU beyond float rounding (a
  row computed alone or among others differs by ~1e-6 relative; the greedy token changes only at an exact near-tie,
  as between any two float implementations); the manifest's `lossless` stands and calls are not padded;
- int8 activations or an int8 KV cache on ONNX Runtime: an int8 rounding (of the next layer's input, of a key or
  value written to the cache) turns any last-bit difference into another value, so the probe's verdict gives the
  step padding (`min_rows`) that makes every kernel row-invariant. Every engine of the build pads the same way on the
  same machine, so a speculative engine reproduces its `none` engine bit for bit. Where no padding the graph
  supports does it, a speculative engine is refused in one line unless the caller allows it to run labelled lossy
  (`--allow-lossy`); a `none` engine runs unpadded (it is the model; it is the speculative engines that cannot
  match it). Branching trees there (engine.yaml's needs_ordered_attention) are exact only on specbuild's ordered
  attention (runtime/kernels); without the kernel library they are refused the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.modes.registry import baseline_mode
from specbuild.runtime import kernels as own_kernels


@dataclasses.dataclass
class Exactness:
    """lossless: what this run promises. min_rows: rows every call is padded to. verified: how that was
    established on this machine, in words. probe: the row-invariance verdict (int8 activations or an int8 cache).
    kernels: which kernels the graph runs on, in words (graphs some of whose kernels runtime/kernels takes: int4
    weights, int8 activations or an int8 KV cache)."""

    lossless: bool
    min_rows: int
    verified: str
    probe: object | None = None
    kernels: str | None = None

    def to_dict(self) -> dict:
        out = {"lossless": self.lossless, "min_rows": self.min_rows, "verified": self.verified}
        if self.probe is not None:
            out["probe"] = self.probe.to_dict()
        if self.kernels is not None:
            out["kernels"] = self.kernels
        return out


def accuracy_level(graph: dict) -> int:
    return int((graph.get("quantization") or {}).get("accuracy_level", 1))


def int8_activations(graph: dict) -> bool:
    return accuracy_level(graph) == ef.ACCURACY_INT8


def int8_cache(graph: dict) -> bool:
    return graph.get(ef.GRAPH_KV_CACHE_DTYPE, ef.KV_CACHE_FLOAT) == ef.KV_CACHE_INT8


def decide(engine_dir: Path, manifest: dict, graph: dict, backend: str, threads: int, allow_lossy: bool) -> Exactness:
    """The Exactness of this engine on this machine (see the module docstring); raises SpecbuildError when a
    speculative engine cannot be exact here and allow_lossy is false. threads: resolved (resolve_threads)."""
    promised = bool(manifest.get("lossless", True))
    if backend != ef.BACKEND_ONNXRUNTIME or not (int8_activations(graph) or int8_cache(graph)):
        verified = "float activations: rows agree to float rounding, nothing to measure on this CPU"
        if backend != ef.BACKEND_ONNXRUNTIME:
            verified = "TensorRT plan: float activations, nothing to measure on this CPU"
        own = backend == ef.BACKEND_ONNXRUNTIME and any(own_kernels.wanted(graph))  # int4 matmuls
        return Exactness(promised, 1, verified, kernels=own_kernels.description() if own else None)
    verdict = _decide_probed(engine_dir, manifest, graph, threads, allow_lossy)
    return dataclasses.replace(verdict, kernels=own_kernels.description())


def _decide_probed(engine_dir: Path, manifest: dict, graph: dict, threads: int, allow_lossy: bool) -> Exactness:
    """decide() for int8 activations or an int8 cache on ONNX Runtime: the row-invariance probe's verdict."""
    promised = bool(manifest.get("lossless", True))
    if not promised:
        return Exactness(False, 1, f"labelled lossy by the build ({manifest.get('lossy_reason')})")
    if manifest.get(ef.NEEDS_ORDERED_ATTENTION) and own_kernels.library() is None:
        reason = "its branching trees are exact on specbuild's ordered attention, and it runs on "
        reason += own_kernels.description()
        if not allow_lossy:
            raise SpecbuildError(
                f"{engine_dir}: engine.yaml says lossless, but {reason}; make the kernel library available (a C++ "
                "compiler, SPECBUILD_KERNELS unset) or pass --allow-lossy to run it labelled lossy"
            )
        return Exactness(False, 1, f"not exact here: {reason}")
    from specbuild.runtime.row_invariance import blocking, check_graph, engine_min_rows

    pad = int(graph.get("attention_pad_rows", 0))
    paddable = any(i["name"] == ef.MIN_ROWS for i in graph["io"]["inputs"])
    limit = pad + 1 if paddable else 1  # scratch cache slots after the tokens bound the padding
    graph_file = Path(engine_dir) / graph["file"]
    sha = manifest["checksums"][graph["file"]]["sha256"]
    limits = manifest["limits"]
    # the most rows one call holds: every KV slot's sequence with a full tree (and its attention padding)
    rows = int(limits.get("max_batch_size", 1)) * (int(limits["max_new_tokens_per_step"]) + pad)
    probe = check_graph(graph_file, sha, threads, accuracy_level(graph), pad, limit, rows)
    source = "kept from an earlier load" if probe.cached else f"measured in {probe.seconds:.2f} s"
    if probe.min_rows is not None:
        padding = "no padding" if probe.min_rows == 1 else f"every call padded to {probe.min_rows} rows"
        return Exactness(True, probe.min_rows, f"row-invariant kernels on {probe.cpu} with {padding} ({source})", probe)
    culprits = blocking(probe.kernels, pad, limit)
    named = ", ".join(culprits[:2]) + (f" and {len(culprits) - 2} more" if len(culprits) > 2 else "")
    if manifest["speculative_mode"] == baseline_mode():
        plain = f"plain decoding; on {probe.cpu} this graph cannot pad {named} to row invariance"
        return Exactness(True, 1, plain, probe)
    reason = f"on {probe.cpu} {named} give a token other bits in calls of other sizes"
    rebuild = engine_min_rows(probe.kernels, pad, pad + 1) is not None  # a padded graph would be exact
    if allow_lossy:
        return Exactness(False, 1, f"not exact on this CPU: {reason}", probe)
    fix = (
        "rebuild it with this specbuild (its graph pads calls to stay exact on such CPUs)"
        if rebuild
        else "build with float activations and a float KV cache for an exact engine"
    )
    raise SpecbuildError(
        f"{engine_dir}: engine.yaml says lossless, but {reason} and the graph cannot pad calls enough to hide it; "
        f"{fix}, or pass --allow-lossy to run it labelled lossy"
    )
