"""How many tokens each step verifies: the engine's measured cost per call against the tokens the drafts are expected
to add, so that speculation is only used where it pays and a speculative engine never runs slower than itself with
speculation off.

A call of B sequences x T tokens costs `CostCurve.cost(B, T)`: measured on the machine that runs the engine the first
time it is needed (the engine's own graph, drafting the next trees; a graph that can skip its drafting also has the
price of a plain B x 1 call that drafts nothing), for B on a grid (1, 2, 4, ... and the slots), the token counts of
one B timed in turns so that their ratio -- all the choice depends on -- is not skewed by a slow moment; other B are
interpolated; kept in the user cache.

Each step the scheduler has one proposal per running sequence; rows are padded to the step's T. `Speculation.plan`
picks T: 1 (plain decoding through the same graph), the longest proposal, or a power of two in between when the
longer proposals are chains (a chain's first T tokens are a proposal of their own; a tree is verified whole or not at
all). It takes the T with the most expected tokens per millisecond, a T > 1 only where that beats plain decoding by
DRAFT_MARGIN. A row verifying a chain or tree of depth D is
expected to give 1 + sum_j prod_{d<=j} q_d tokens, q_d being the learnt chance that the draft at depth d is accepted
once the ones above it were. q is learnt from every proposal, verified or not: each is compared with the tokens the
sequence then emits (its `Shadow`), which is exactly what verifying it would have accepted -- greedy, and sampled
too, since a row's random numbers belong to its positions (runtime/batch.py). So plain steps teach as much as drafted
ones, no step drafts only to learn, and the choice moves continuously with the batch size: no threshold to fall off.
An engine whose graph drafts the next trees (EAGLE, Medusa, ReDrafter) pays for that drafting in every call that
does it, whatever T the next step takes: each call, `Speculation.drafts` compares drafting and verifying whole trees
every call with plain calls that draft nothing (ef.DRAFT_ROWS empty; both priced by the curve at this batch size),
so under load such an engine falls back to the cost of plain decoding instead of paying for drafts it does not
verify. A lone sequence verifies its whole proposal (every mode's measured batch-1 speed-up stands, nothing is
measured before its first tokens), unless its drafts cost time of their own to make (a draft model's calls: a
drafter with `paid_drafts`, `Speculation.budget`; one whose cut proposals are proposals of their own, token
recycling's ranked tree, prices every cut itself: `Drafter.expected_tokens`, Shape.gains). Those are priced at
every batch size; a lone sequence's by the times of its own steps (`LoneCalls`: robust medians per call size, never
falling with more rows; the curve is not measured for it, so its first tokens wait for nothing): it drafts until a
plain call has been timed, then as far as pays. Alone, both choices keep being observed: a drafter
kept from drafting proposes nothing and so teaches nothing about its acceptance, so every EXPLORE_EVERY-th such step
it drafts its whole chain anyway; one that drafts takes a plain step every REFRESH_PLAIN-th step, so the price of
plain calls follows its context's growth. (Under load the choice is the curve's alone: a chain drafted by every row
to learn would cost a whole batch of draft calls.)
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time

import numpy as np

from specbuild.errors import SpecbuildError
from specbuild.runtime import user_cache

SPECULATION_POLICIES = ("auto", "always", "off")
POLICY_VARIABLE = "SPECBUILD_SPECULATION"  # the default policy when none is given (the tests pin `always`)
CACHE_NAME = "call-cost"
COST_VERSION = 5
PLAIN_SUFFIX = "-plain"  # a cost point's name: BxT, or Bx1-plain for a call that drafts no next tree
PRIOR_ACCEPTANCE = 0.5  # chance of a draft being accepted after its parent, before anything was observed
EMA = 0.02  # weight of one observation in the running chances
WARMUP = 3  # rounds of a new batch size before it is timed: ONNX Runtime's first calls of a shape are slower
REPEATS = 5
COST_CONTEXT = 256  # cached positions of every sequence in a timed call
# a step drafts only where that is expected to give this many times the tokens per ms of plain decoding: what the
# curve does not see (committing drafted rows, a drafter's host work, the spread of the measurement) must not turn
# an expected small gain into a loss (measured: 1.0 cost 3-8 % at C=4-16 on SmolLM2's n-gram engines)
DRAFT_MARGIN = 1.1
# a drafter that pays per draft and is kept from drafting drafts its whole chain once in this many steps (its
# acceptance is learnt only from drafts it makes): at most ~1/16 of the steps at a loss while it is off; a lone
# sequence that drafts times its first plain call after as many drafted steps
EXPLORE_EVERY = 16
REFRESH_PLAIN = 64  # a lone sequence that drafts takes a plain step once in this many steps (<= ~1 % of its tokens)


def _powers_of_two_upto(limit: int) -> list[int]:
    out, p = [], 1
    while p < limit:
        out.append(p)
        p *= 2
    return [*out, limit]


class CostCurve:
    """Milliseconds per call of B sequences x T tokens on this machine (see the module docstring): B measured at
    1, 2, 4, ... and `slots`, interpolated between; T at 1, 2, 4, ... and the engine's most tokens per step, a count
    in between priced as the next measured one. A graph that can skip its drafting (`plain_calls`) also has the
    price of a plain call (T = 1, no next tree drafted), timed in turns with the others."""

    def __init__(self, run_call, key: str, cpu: str, step_tokens: int, slots: int = 1, plain_calls: bool = False):
        """run_call(b, t, draft) -> engine seconds of one b x t call (draft=False: one that drafts no next tree)."""
        self._run_call, self.key, self.cpu, self.step_tokens = run_call, key, cpu, step_tokens
        self.plain_calls = plain_calls
        self.batch_grid = _powers_of_two_upto(max(1, slots))
        kept = user_cache.get(CACHE_NAME, key)
        self.points: dict[tuple[int, int, bool], float] = {}  # (B, T, drafting) -> ms
        if isinstance(kept, dict):
            for name, ms in kept.get("points", {}).items():
                b, _, t = name.removesuffix(PLAIN_SUFFIX).partition("x")
                if b.isdigit() and t.isdigit() and isinstance(ms, (int, float)):
                    self.points[int(b), int(t), not name.endswith(PLAIN_SUFFIX)] = float(ms)
        self.cached = bool(self.points)  # some points came from an earlier run
        self.seconds = 0.0  # spent measuring in this process

    def snap(self, tokens: int) -> int:
        """The measured token count that prices a call of `tokens` tokens per row."""
        t = 1
        while t < tokens:
            t *= 2
        return min(t, max(self.step_tokens, tokens))

    def _grid_around(self, batch: int) -> tuple[int, int]:
        for lo, hi in zip(self.batch_grid, self.batch_grid[1:]):
            if lo <= batch <= hi:
                return lo, hi
        top = max(self.batch_grid[-1], batch)
        return top, top

    def costs(self, batch: int, tokens: list[int]) -> list[float]:
        """ms of a call of `batch` sequences for each entry of `tokens`; the missing points are measured together."""
        return self._priced(batch, [(self.snap(t), True) for t in tokens])

    def cost(self, batch: int, tokens: int) -> float:
        return self.costs(batch, [tokens])[0]

    def plain_and_drafting(self, batch: int) -> tuple[float, float]:
        """ms of a plain call (T = 1, no next tree drafted) and of one verifying and drafting whole trees."""
        plain, drafting = self._priced(batch, [(1, not self.plain_calls), (self.step_tokens, True)])
        return plain, drafting

    def _priced(self, batch: int, shapes: list[tuple[int, bool]]) -> list[float]:
        lo, hi = self._grid_around(batch)
        for b in sorted({lo, hi}):
            self._measure(b, sorted({s for s in shapes if (b, *s) not in self.points}))
        share = 0.0 if hi == lo else (batch - lo) / (hi - lo)
        low, high = [self.points[(lo, *s)] for s in shapes], [self.points[(hi, *s)] for s in shapes]
        return [a + share * (b - a) for a, b in zip(low, high)]

    def _measure(self, batch: int, shapes: list[tuple[int, bool]]) -> None:
        """Time the calls of `batch` x each (tokens, drafting) shape in turns (WARMUP rounds, then the median of
        REPEATS)."""
        if not shapes:
            return
        start = time.perf_counter()
        for _ in range(WARMUP):
            for t, draft in shapes:
                self._run_call(batch, t, draft)
        times = {s: [] for s in shapes}
        for _ in range(REPEATS):
            for t, draft in shapes:
                times[t, draft].append(self._run_call(batch, t, draft))
        for s in shapes:
            self.points[(batch, *s)] = 1000 * float(np.median(times[s]))
        self.seconds += time.perf_counter() - start
        user_cache.put(CACHE_NAME, self.key, self.to_dict())

    def prepare(self, batch: int) -> None:
        """Measure every point a step of up to `batch` sequences can need (each grid B up to it, every T)."""
        shapes = [(t, True) for t in _powers_of_two_upto(self.step_tokens)]
        if self.plain_calls:
            shapes.append((1, False))
        for b in self.batch_grid:
            if b <= batch or b == self._grid_around(batch)[1]:
                self._priced(b, shapes)

    def rows_curve(self, rows: list[int], slots: int) -> list[tuple[int, float]]:
        """(rows per call, ms) with rows = B x T, B = min(rows, slots): what batching can give on this machine."""
        return [(r, self.cost(min(r, slots), -(-r // min(r, slots)))) for r in rows]

    def to_dict(self) -> dict:
        points = {f"{b}x{t}{'' if d else PLAIN_SUFFIX}": ms for (b, t, d), ms in sorted(self.points.items())}
        return {"points": points, "cpu": self.cpu}


class LoneCalls:
    """ms of one sequence's calls by tokens per call, as its own steps took them: what prices a lone sequence's
    drafts without measuring the cost curve before its first tokens. Per token count, the median of its last WINDOW
    calls; the first call of a count prices it only until a second one comes (ONNX Runtime's first call of a new
    shape is slower: a count taken rarely would keep that price), so one slow call does not turn the choice."""

    WINDOW = 9

    def __init__(self):
        self._recent: dict[int, collections.deque] = {}  # tokens per call -> its last WINDOW engine ms
        self._first: set[int] = set()  # counts timed once, by their first call
        self.ms: dict[int, float] = {}  # tokens per call -> the median of those

    def add(self, tokens: int, ms: float) -> None:
        recent = self._recent.get(tokens)
        if recent is None:
            recent = self._recent[tokens] = collections.deque(maxlen=self.WINDOW)
            self._first.add(tokens)
        elif tokens in self._first:  # the second call: the first (a new shape's) no longer counts
            self._first.discard(tokens)
            recent.clear()
        recent.append(ms)
        self.ms[tokens] = float(np.median(recent))

    @property
    def plain_timed(self) -> bool:
        """Whether a plain call (1 token) has been timed."""
        return 1 in self.ms

    def costs(self, tokens: list[int]) -> list[float] | None:
        """ms of a call of each of `tokens`, interpolated between the counts timed (held past the last), those made
        non-decreasing in the tokens (`_monotone`: a call of more rows never costs less); None until a plain call (1
        token) and a longer one have been timed."""
        if not self.plain_timed or len(self.ms) < 2:
            return None
        timed = sorted(self.ms)
        ms = _monotone([self.ms[t] for t in timed], [len(self._recent[t]) for t in timed])
        return np.interp(tokens, timed, ms).tolist()


def _monotone(values: list[float], weights: list[int]) -> list[float]:
    """The non-decreasing sequence nearest `values` in weighted least squares (pool adjacent violators): a noisy
    point below an earlier one is averaged with it instead of making a longer call look cheaper."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(n)]


def resolve_policy(policy: str | None = None) -> str:
    """`policy`, else $SPECBUILD_SPECULATION, else auto; anything else is a one-line SpecbuildError."""
    policy = policy or os.environ.get(POLICY_VARIABLE, "").strip() or "auto"
    if policy not in SPECULATION_POLICIES:
        raise SpecbuildError(f"--speculation must be one of {', '.join(SPECULATION_POLICIES)}, got {policy!r}")
    return policy


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the plan needs of a proposal: its tokens (root included), depth, and whether its first k tokens are a
    proposal too (a chain)."""

    size: int
    depth: int
    chain: bool
    # expected tokens of the proposal cut to its first t tokens, t = 1..size: a proposal whose every prefix is one
    # (a best-first tree), priced by its drafter; None: by the acceptance learnt per depth
    gains: tuple[float, ...] | None = None

    @classmethod
    def of(cls, proposal) -> Shape:
        """depth: of the deepest root-to-leaf path, the drafts verified (rows on no path, e.g. a Jacobi window, only
        cost)."""
        depth = int((proposal.paths[0] >= 0).sum(-1).max()) - 1 if proposal.size else 0
        return cls(proposal.size, depth, depth == proposal.size - 1)

    def verified(self, tokens: int) -> int:
        """Depth verified when the step has `tokens` tokens per row: a chain's first ones, a tree whole or not."""
        if self.size <= tokens:
            return self.depth
        return tokens - 1 if self.chain else 0


class Shadow:
    """One proposal's drafts (its root-to-leaf token paths), compared with the tokens its sequence emits next until
    one differs or the deepest is matched: the drafts that verifying it would have accepted."""

    def __init__(self, paths: list[tuple[int, ...]]):
        self.paths, self.matched = paths, 0
        self.depth = max(len(p) for p in paths)

    @classmethod
    def of(cls, proposal) -> Shadow | None:
        tokens = proposal.tokens[0]
        paths = {tuple(int(tokens[n]) for n in row[1:] if n >= 0) for row in proposal.paths[0]}
        paths.discard(())
        return cls(sorted(paths)) if paths else None

    def feed(self, token: int) -> bool:
        """Advance by one emitted token; True when the outcome is known (`matched` drafts)."""
        paths = [p for p in self.paths if len(p) > self.matched and p[self.matched] == token]
        if not paths:
            return True
        self.paths, self.matched = paths, self.matched + 1
        return self.matched >= self.depth


class Speculation:
    """The per-step choice of how many tokens each row verifies (see the module docstring).

    policy: "auto" (the cost model), "always" (every proposal whole) or "off" (roots only)."""

    def __init__(self, policy: str = "auto", curve_source=None, plain_calls: bool = False):
        """plain_calls: the engine's graph can skip drafting the next trees (ef.DRAFT_ROWS)."""
        self.policy = policy
        self._curve_source = curve_source  # () -> CostCurve, measured on first need
        self.curve: CostCurve | None = None
        self.plain_calls = plain_calls
        self._drafts: Shape | None = None  # the shape of the engine's drafts, as last proposed
        self.q = np.full(1, PRIOR_ACCEPTANCE)  # q[d - 1]: chance of depth d after depth d - 1 was accepted
        self._gains: list[float] | None = None  # _gains[d] = expected(d), kept until q changes
        self._shadows: dict[object, list[Shadow]] = {}
        self.lone = LoneCalls()  # a lone sequence's calls, timed by its steps (`timed`)
        self._drafting, self._same_choice = True, 0  # `budget`'s last choice for a paying drafter, steps in a row
        self.drafted_steps = 0
        self.plain_steps = 0
        self.rows = 0  # token rows of the steps (sequences x T)
        self.padded_rows = 0  # of which padding

    def expected(self, depth: int) -> float:
        """Tokens a row verifying drafts down to `depth` is expected to give (the bonus token included)."""
        if depth > len(self.q):
            self.q = np.concatenate([self.q, np.full(depth - len(self.q), PRIOR_ACCEPTANCE)])
            self._gains = None
        if self._gains is None:  # a step prices every row at every candidate T: one pass over q, not one per row
            self._gains = [1.0, *(1.0 + np.cumsum(np.cumprod(self.q))).tolist()]
        return self._gains[depth]

    def drafts(self, shapes: list[Shape]) -> bool:
        """Whether this step's call drafts the next trees. Always, unless the graph can skip its drafting; then only
        where drafting and verifying whole trees every call is expected to beat plain calls by DRAFT_MARGIN in
        tokens per ms at this batch size (else the rows decode plainly, their graph drafting nothing)."""
        grown = [s for s in shapes if s.size > 1]
        if grown:
            self._drafts = max(grown, key=lambda s: s.size)
        if not self.plain_calls:
            return True
        if self.policy != "auto":
            return self.policy == "always"
        if len(shapes) == 1 or self._drafts is None:
            return True
        plain_ms, drafting_ms = self._curve().plain_and_drafting(len(shapes))
        return self.expected(self._drafts.depth) / drafting_ms >= DRAFT_MARGIN / plain_ms

    def _curve(self) -> CostCurve:
        if self.curve is None:
            self.curve = self._curve_source()
        return self.curve

    def budget(self, batch: int, longest: int, draft_ms: float, gains: tuple[float, ...] | None = None) -> int:
        """Tokens per row (root included) that a step of `batch` rows would verify if each proposed a `longest`-token
        chain whose drafts cost `draft_ms` each to make: what a drafter that pays per draft (a draft model) drafts.
        `gains`: the drafter's own price of its proposal cut to t tokens (Shape.gains; a best-first tree) instead of
        a chain's. Priced at every batch size; alone, the other choice is explored now and then (module docstring)."""
        shape = Shape(longest, longest - 1, True) if gains is None else Shape(longest, longest - 1, False, gains)
        tokens = self.plan([shape] * batch, draft_ms)
        if self.policy != "auto" or longest <= 1 or batch > 1:
            return tokens
        if (tokens > 1) != self._drafting:
            self._drafting, self._same_choice = tokens > 1, 0
        self._same_choice += 1
        if tokens == 1 and self._same_choice >= EXPLORE_EVERY:
            tokens = longest  # kept from drafting: draft once to go on learning the acceptance
        elif tokens > 1 and self._same_choice >= (REFRESH_PLAIN if self.lone.plain_timed else EXPLORE_EVERY):
            tokens = 1  # drafting: time a plain call
        else:
            return tokens
        self._drafting, self._same_choice = tokens > 1, 0
        return tokens

    def timed(self, batch: int, tokens: int, seconds: float) -> None:
        """A decoding step's call of `batch` rows x `tokens` tokens took `seconds` of engine time."""
        if batch == 1:
            self.lone.add(tokens, 1000 * seconds)

    def plan(self, shapes: list[Shape], draft_ms: float = 0.0) -> int:
        """Tokens per row of this step: 1 (roots only) up to the longest proposal. draft_ms: what each draft token of
        a row costs to make besides the call (a draft model's), added to the price of every candidate T."""
        longest = max(s.size for s in shapes)
        if self.policy == "off" or longest <= 1:
            return 1
        if self.policy == "always" or (len(shapes) == 1 and draft_ms == 0.0):  # alone: free drafts are verified
            return longest
        if all(s.gains is not None for s in shapes if s.size > 1):  # every cut is a proposal, priced by its drafter
            cut = list(range(2, longest))
        else:
            cut = [t for t in _powers_of_two_upto(longest)[1:-1] if all(s.chain for s in shapes if s.size > t)]
        candidates = [1, *cut, longest]
        costs = self.lone.costs(candidates) if len(shapes) == 1 else self._curve().costs(len(shapes), candidates)
        if costs is None:  # alone, no plain call timed yet
            return longest
        costs = [ms + draft_ms * (t - 1) * len(shapes) for t, ms in zip(candidates, costs)]
        rates = [sum(self._tokens(s, t) for s in shapes) / ms for t, ms in zip(candidates, costs)]
        best = 1 + int(np.argmax(rates[1:]))
        return candidates[best] if rates[best] >= DRAFT_MARGIN * rates[0] else 1

    def _tokens(self, shape: Shape, t: int) -> float:
        """Tokens a row of `shape` is expected to give when the step verifies `t` tokens per row."""
        if shape.gains is not None:
            return shape.gains[min(t, shape.size) - 1]
        return self.expected(shape.verified(t))

    def observe(self, key, proposal, emitted: list[int]) -> None:
        """After a step: `proposal` was this sequence's (`key`) proposal before it (verified whole, in part or not at
        all) and `emitted` the tokens the step accepted for it. Earlier proposals still being compared go on."""
        shadows = self._shadows.setdefault(key, [])
        new = Shadow.of(proposal)
        if new is not None:
            shadows.append(new)
        alive = []
        for shadow in shadows:
            if any(shadow.feed(token) for token in emitted):
                self._learn(shadow.matched, shadow.depth)
            else:
                alive.append(shadow)
        self._shadows[key] = alive

    def _learn(self, matched: int, depth: int) -> None:
        self.expected(depth)  # q covers depth
        reached = min(matched + 1, depth)
        hits = np.arange(1, reached + 1) <= matched
        self.q[:reached] += EMA * (hits - self.q[:reached])
        self._gains = None

    def forget(self, key) -> None:
        """The sequence left: its proposals are no longer compared."""
        self._shadows.pop(key, None)

    def count(self, tokens: int, sizes: list[int]) -> None:
        """A step of `tokens` tokens per row whose rows verified `sizes` tokens."""
        if tokens > 1:
            self.drafted_steps += 1
        else:
            self.plain_steps += 1
        self.rows += tokens * len(sizes)
        self.padded_rows += sum(tokens - s for s in sizes)
