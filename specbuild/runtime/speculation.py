"""How much to draft under load: the engine's measured cost per call against the tokens the drafts are expected to
add, so that speculation never costs throughput.

A call of B sequences x T tokens costs `CostCurve.ms(B, T)`, measured on the machine that runs the engine (the
engine's own graph with its drafting, so that a root-only call of an engine-drafted mode is priced with the
drafting it still does) and kept in the user cache. Each step the scheduler has one proposal per running sequence;
rows are padded to the longest, so a step either verifies the proposals (T = the longest) or only the roots
(T = 1, plain decoding through the same graph). Expected tokens: 1 per row plainly, 1 + a * (N_i - 1) for a
proposal of N_i tokens, where `a` is the running share of drafted tokens accepted, learnt from the steps that
drafted. The step takes whichever gives more tokens per millisecond: at low concurrency a CPU call of a few more
rows costs little and the drafts pay; as B grows each extra row costs more and plain decoding wins exactly where
the expected gain falls below the cost -- a continuous trade-off, no threshold to fall off. While plain decoding is
chosen, one step in EXPLORE_EVERY still drafts, so that `a` follows the text.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from specbuild.runtime import user_cache

CACHE_NAME = "call-cost"
COST_VERSION = 1
PRIOR_ACCEPTANCE = 0.5  # share of drafted tokens accepted before any step measured it
EMA = 0.05  # weight of one row's observation in the running share
EXPLORE_EVERY = 16
REPEATS = 3


@dataclasses.dataclass
class CostCurve:
    """Milliseconds per call measured on a grid of batch sizes x tokens per row; interpolated in between."""

    batches: list[int]
    tokens: list[int]
    ms: list[list[float]]  # [len(batches)][len(tokens)]
    cpu: str = ""
    seconds: float = 0.0
    cached: bool = False

    def cost(self, batch: int, tokens: int) -> float:
        """Interpolated (linearly in each axis; extrapolated linearly past the grid) ms of a B x T call."""
        grid = np.asarray(self.ms)
        per_b = np.array([_interp(tokens, self.tokens, row) for row in grid])
        return float(_interp(batch, self.batches, per_b))

    def rows_curve(self, rows: list[int], slots: int) -> list[tuple[int, float]]:
        """(rows per call, ms) with rows = B x T, B = min(rows, slots): what batching can give on this machine."""
        return [(r, self.cost(min(r, slots), max(1, -(-r // min(r, slots))))) for r in rows]

    def to_dict(self) -> dict:
        return {"batches": self.batches, "tokens": self.tokens, "ms": self.ms, "cpu": self.cpu}


def _interp(x: float, xs: list[int], ys) -> float:
    xs = np.asarray(xs, dtype=np.float64)
    ys = np.asarray(ys, dtype=np.float64)
    if len(xs) == 1:
        return float(ys[0] * x / xs[0])
    if x > xs[-1]:  # past the grid: the last segment's slope
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


def grid(slots: int, step_tokens: int) -> tuple[list[int], list[int]]:
    batches = sorted({1, *[b for b in (2, 4, 8, 16, 32, 64) if b < slots], slots})
    tokens = sorted({1, *[t for t in (2, 4, 8, 16) if t < step_tokens], step_tokens})
    return batches, tokens


def measure(run_call, slots: int, step_tokens: int, key: str, cpu: str) -> CostCurve:
    """The engine's cost grid, from the user cache or measured now. run_call(b, t) -> seconds of one b x t call."""
    batches, tokens = grid(slots, step_tokens)
    kept = user_cache.get(CACHE_NAME, key)
    if isinstance(kept, dict) and kept.get("batches") == batches and kept.get("tokens") == tokens:
        return CostCurve(batches, tokens, kept["ms"], kept.get("cpu", cpu), 0.0, cached=True)
    start = time.perf_counter()
    ms = []
    for b in batches:
        run_call(b, tokens[0])  # warm-up: allocations for this batch size
        ms.append([1000 * float(np.median([run_call(b, t) for _ in range(REPEATS)])) for t in tokens])
    curve = CostCurve(batches, tokens, ms, cpu, time.perf_counter() - start)
    user_cache.put(CACHE_NAME, key, curve.to_dict())
    return curve


class Speculation:
    """The per-step choice between verifying the proposals and plain decoding (see the module docstring).

    policy: "auto" (the cost model), "always" (verify every proposal) or "off" (roots only)."""

    def __init__(self, policy: str = "auto", curve_source=None):
        self.policy = policy
        self._curve_source = curve_source  # () -> CostCurve, measured on first need
        self.curve: CostCurve | None = None
        self.acceptance = PRIOR_ACCEPTANCE
        self._plain_steps = 0
        self.drafted_steps = 0
        self.plain_steps = 0

    def draft(self, sizes: list[int]) -> bool:
        """Whether this step verifies proposals of `sizes` tokens (one per row) rather than the roots alone."""
        longest = max(sizes)
        if longest <= 1 or self.policy == "always":
            return longest > 1
        if self.policy == "off":
            return False
        if self.curve is None:
            self.curve = self._curve_source()
        b = len(sizes)
        plain = b / self.curve.cost(b, 1)
        expected = sum(1.0 + self.acceptance * (n - 1) for n in sizes)
        drafted = expected / self.curve.cost(b, longest)
        if drafted >= plain:
            self._plain_steps = 0
            return True
        self._plain_steps += 1
        return self._plain_steps % EXPLORE_EVERY == 0  # keep the acceptance estimate current

    def observe(self, sizes: list[int], accepted: list[int]) -> None:
        """A drafted step's rows: proposal sizes and accepted tokens (bonus included)."""
        for n, got in zip(sizes, accepted):
            if n > 1:
                self.acceptance += EMA * ((got - 1) / (n - 1) - self.acceptance)

    def count(self, drafted: bool) -> None:
        if drafted:
            self.drafted_steps += 1
        else:
            self.plain_steps += 1
