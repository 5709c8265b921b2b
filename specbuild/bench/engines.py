"""The engines a benchmark runs: loaded side by side after the checks every benchmark makes, labelled, and compared
with the `none` engine of their own precision."""

from __future__ import annotations

from pathlib import Path

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.host_memory import available_bytes
from specbuild.modes.registry import get_mode


def _label(path: Path, mode: str, used: set[str]) -> str:
    label = f"{path.name} ({mode})"
    while label in used:
        label += "'"
    used.add(label)
    return label


def engine_precision(engine) -> tuple:
    """(weights, activations, KV cache, kernels) of an engine: engines that differ in any give other tokens."""
    weights = engine.manifest.get("weights", {})
    kv_cache = weights.get(ef.GRAPH_KV_CACHE_DTYPE, ef.KV_CACHE_FLOAT)
    return weights.get("precision"), weights.get("activations", "float"), kv_cache, engine.kernels_tag


def is_plain(engine) -> bool:
    """Whether the engine decodes plainly (the baseline mode)."""
    return get_mode(engine.manifest["speculative_mode"]).baseline


def load_engines(
    engine_dirs, max_new_tokens: int, threads: int | None, allow_lossy: bool, stock_kernels: bool = False
) -> tuple[list, list[str]]:
    """The engines to benchmark and their row labels, after the checks every benchmark makes. stock_kernels: each
    engine that runs on specbuild's kernels (runtime/kernels) also on ONNX Runtime's own, as a row of its own."""
    from specbuild.runtime import kernels
    from specbuild.runtime.engine import Engine

    if not engine_dirs:
        raise SpecbuildError("give at least one --engine-dir")
    if max_new_tokens < 1:
        raise SpecbuildError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_engines_fit(engine_dirs, available_bytes())
    engines, labels, used = [], [], set()
    for d in engine_dirs:
        engine = Engine(d, threads=threads, allow_lossy=allow_lossy)
        engines.append(engine)
        labels.append(_label(Path(d), engine.manifest["speculative_mode"], used))
    for d, engine in list(zip(engine_dirs, engines)) if stock_kernels else []:
        if engine.kernels_tag != "stock":
            with kernels.stock():  # branching trees at int8 activations are not exact there: run, labelled lossy
                engines.append(Engine(d, threads=threads, allow_lossy=True))
            labels.append(_label(Path(d), f"{engine.manifest['speculative_mode']}, stock kernels", used))
    return engines, labels


def check_engines_fit(engine_dirs, available: int | None) -> None:
    """The engines are loaded side by side (every prompt runs through each in turn) and ONNX Runtime holds at least
    their files while they are: refuse, before loading any, engines whose files exceed the `available` bytes."""
    sizes = {str(d): sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file()) for d in engine_dirs}
    total = sum(sizes.values())
    if available is None or total <= available:
        return
    largest = max(sizes, key=sizes.get)
    raise SpecbuildError(
        f"--engine-dir: the {len(sizes)} engines take {total / 1e9:.1f} GB together, more than the "
        f"{available / 1e9:.1f} GB this machine has available, and a benchmark holds them all at once: run fewer "
        f"engines per benchmark (the largest, {largest}, takes {sizes[largest] / 1e9:.1f} GB)"
    )


def own_none(engines: list, labels: list[str]) -> list[str | None]:
    """For each engine, the label of the `none` engine of its precision (its exactness reference), if one runs."""
    plain = [is_plain(e) for e in engines]
    precision = [engine_precision(e) for e in engines]
    return [
        next((labels[i] for i in range(len(engines)) if plain[i] and precision[i] == mine), None) for mine in precision
    ]
