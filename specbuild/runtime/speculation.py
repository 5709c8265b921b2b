"""How much to draft under load: the engine's measured cost per call against the tokens the drafts are expected to add,
so that speculation is only used where it pays (measured so far: it pays alone, not yet under load -- see the
issue-28 note: the forced exploration steps and padding to the longest proposal still cost throughput at C >= 4).

A call of B sequences x T tokens costs `CostCurve.cost(B, T)`, measured on the machine that runs the engine the
first time that shape is needed (the engine's own graph with its drafting, so that a root-only call of an engine-
drafted mode is priced with the drafting it still does) and kept in the user cache. Each step the scheduler has one
proposal per running sequence; rows are padded to the longest, so a step either verifies the proposals (T = the
longest) or only the roots (T = 1, plain decoding through the same graph); a lone sequence always drafts. Expected
tokens: 1 per row plainly, 1 + a * (N_i - 1) for a proposal of N_i tokens, where `a` is the running share of drafted
tokens accepted, learnt from the steps that drafted. The step takes whichever gives more tokens per millisecond: at
low concurrency a CPU call of a few more rows costs little and the drafts pay; as B grows each extra row costs more
and plain decoding wins exactly where the expected gain falls below the cost -- a continuous trade-off, no threshold
to fall off. While plain decoding is chosen, one step in EXPLORE_EVERY still drafts, so that `a` follows the text.
"""

from __future__ import annotations

import os
import time

import numpy as np

from specbuild.errors import SpecbuildError
from specbuild.runtime import user_cache

SPECULATION_POLICIES = ("auto", "always", "off")
POLICY_VARIABLE = "SPECBUILD_SPECULATION"  # the default policy when none is given (the tests pin `always`)
CACHE_NAME = "call-cost"
COST_VERSION = 3
PRIOR_ACCEPTANCE = 0.5  # share of drafted tokens accepted before any step measured it
EMA = 0.05  # weight of one row's observation in the running share
EXPLORE_EVERY = 16
WARMUP = 3  # calls of a new shape before it is timed: ONNX Runtime's first calls of a shape are slower
REPEATS = 5
COST_CONTEXT = 128  # cached positions of every sequence in a timed call


class CostCurve:
    """Milliseconds per call of B sequences x T tokens, measured on this machine the first time a shape is needed
    (WARMUP calls, then the median of REPEATS) and kept in the user cache. T is taken up to the next of
    1, 2, 4, 8, ... (and the engine's most tokens per step), so a few shapes cover every call."""

    def __init__(self, run_call, key: str, cpu: str, step_tokens: int):
        """run_call(b, t) -> engine seconds of one b x t call."""
        self._run_call, self.key, self.cpu, self.step_tokens = run_call, key, cpu, step_tokens
        kept = user_cache.get(CACHE_NAME, key)
        self.points: dict[tuple[int, int], float] = {}
        if isinstance(kept, dict):
            for name, ms in kept.get("points", {}).items():
                b, _, t = name.partition("x")
                if b.isdigit() and t.isdigit() and isinstance(ms, (int, float)):
                    self.points[int(b), int(t)] = float(ms)
        self.cached = bool(self.points)  # some points came from an earlier run
        self.seconds = 0.0  # spent measuring in this process

    def snap(self, tokens: int) -> int:
        """The measured token count that prices a call of `tokens` tokens per row."""
        t = 1
        while t < tokens:
            t *= 2
        return min(t, max(self.step_tokens, tokens))

    def cost(self, batch: int, tokens: int) -> float:
        key = (batch, self.snap(tokens))
        if key not in self.points:
            start = time.perf_counter()
            for _ in range(WARMUP):
                self._run_call(*key)
            self.points[key] = 1000 * float(np.median([self._run_call(*key) for _ in range(REPEATS)]))
            self.seconds += time.perf_counter() - start
            user_cache.put(CACHE_NAME, self.key, self.to_dict())
        return self.points[key]

    def rows_curve(self, rows: list[int], slots: int) -> list[tuple[int, float]]:
        """(rows per call, ms) with rows = B x T, B = min(rows, slots): what batching can give on this machine."""
        return [(r, self.cost(min(r, slots), -(-r // min(r, slots)))) for r in rows]

    def to_dict(self) -> dict:
        return {"points": {f"{b}x{t}": ms for (b, t), ms in sorted(self.points.items())}, "cpu": self.cpu}


def resolve_policy(policy: str | None = None) -> str:
    """`policy`, else $SPECBUILD_SPECULATION, else auto; anything else is a one-line SpecbuildError."""
    policy = policy or os.environ.get(POLICY_VARIABLE, "").strip() or "auto"
    if policy not in SPECULATION_POLICIES:
        raise SpecbuildError(f"--speculation must be one of {', '.join(SPECULATION_POLICIES)}, got {policy!r}")
    return policy


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
        if len(sizes) == 1:
            # one sequence: a few more rows of a CPU call cost little (SmolLM2: 1.15x for 6 more), every mode's
            # measured batch-1 speed-up stands (docs/benchmarks), and nothing is measured before the first tokens
            return True
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
