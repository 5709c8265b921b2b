"""Lookahead drafting on the host (numpy only): the Jacobi window, the n-gram pool, and each call's rows.

Each call verifies, after the root (the current token, position p):
- the verification branch: the pool's n-grams that start with the root (at most G, most recent first), merged by
  shared prefix into a tree (each one causal within itself, seeing the root);
- the lookahead branch: the window, N - 1 levels of guesses of future tokens. Row 0 is the root and level 0
  (columns 1..W-1, positions p + 1..p + W - 1, causal among themselves); level l >= 1 has W columns, column i at
  position p + i + l, seeing row 0 up to column i and column i of levels 1..l.
With a lookup (L > 0), the verification branch also holds the context's own continuation: what followed the
longest earlier match of the latest tokens in the prompt and the output (runtime/context_index.py), as many tokens
as matched, at most L; a call that has one leaves the window out (there its rows cost more than they give: measured)
and the window waits, unchanged, for the next call without one.
The branches do not see each other; the window's rows lie on no path, so they are never accepted nor committed.
The graph returns every row's argmax (ef.ROW_TOP_TOKENS). From the last level's, the window advances (Jacobi):
while it has fewer than N - 1 levels (the first N - 2 steps) the argmaxes become a new level; then each column i
completes an n-gram -- row 0's token, levels 1..N-2's, the new argmax -- which goes to the pool under its first
token (at most G per key, de-duplicated, the most recent kept), and the window shifts by one position: level 0 <-
level 1 from column 1, level l <- level l + 1, the last level <- the new argmaxes (github.com/hao-ai-lab/
LookaheadDecoding, lade/decoding.py). Level 0 starts as W - 1 tokens of the prompt (a fixed random choice: the same
prompt gives the same drafts). Besides the window's, the pool takes (`pool`) nothing ("window", LADE's default), the
prompt's n-grams at the start ("prompt", LADE's POOL_FROM_PROMPT) or those and each committed token's n-gram as it is
accepted ("context").

Acceptance is the graph's (greedy exact; sampling: the drafts are deterministic, point masses, so the recursive rule
keeps the target distribution). Host work per step is O(W N + G N): it never grows with the context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.plugins.lookahead import LOOKUP_NGRAM, POOLS
from specbuild.runtime.context_index import ContextIndex
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.manifest import check_fields, integer, one_of

WINDOW_SEED = 0x4C4B4148  # "LKAH": level 0's initial tokens are a fixed random choice of the prompt's


@dataclasses.dataclass(frozen=True)
class LookaheadSettings:
    """engine.yaml `mode.drafter` (LookaheadDrafter.SCHEMA)."""

    window: int  # W
    ngram: int  # N
    guesses: int  # G
    pool: str  # what feeds the pool besides the window (POOLS)
    lookup: int = 0  # L: the context's continuation's most tokens (0: none; engines written before the key existed)


class NgramPool:
    """n-grams by first token: at most `per_key` continuations (N - 1 tokens) per key, de-duplicated, the most
    recently added kept."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self._entries: dict[int, list[tuple]] = {}

    def add(self, key: int, continuation: tuple) -> None:
        if self.per_key <= 0:
            return
        entries = self._entries.setdefault(key, [])
        if continuation in entries:
            entries.remove(continuation)
        entries.append(continuation)
        if len(entries) > self.per_key:
            del entries[0]

    def get(self, key: int) -> list[tuple]:
        """The continuations of `key`, most recent first."""
        return self._entries.get(key, [])[::-1]


class LookaheadDrafter(Drafter):
    SCHEMA = {
        "mode": {
            "drafter": {
                "window": integer(1),
                "ngram": integer(1),
                "guesses": integer(0),
                "lookup": integer(0, optional=True),
                "pool": one_of(POOLS),
            }
        }
    }

    @classmethod
    def read_settings(cls, manifest: dict, source: str = "engine.yaml") -> LookaheadSettings:
        check_fields(manifest, cls.SCHEMA, source)
        fields = manifest["mode"]["drafter"]
        sizes = (fields[key] for key in ("window", "ngram", "guesses"))
        return LookaheadSettings(*sizes, fields["pool"], fields.get("lookup", 0))

    @classmethod
    def narrowed(cls, settings: LookaheadSettings, options: Mapping[str, Any]) -> LookaheadSettings:
        """A request's own (w, n, g, l) <= the engine's (W, N, G, L) (as TensorRT-LLM's per-request lookahead config;
        (1, 1, 0, 0) is plain decoding), and its own pool (POOLS)."""
        fields = {}
        for name, value in options.items():
            if name == "pool":
                if value not in POOLS:
                    raise SpecbuildError(f"drafting option pool must be one of {', '.join(POOLS)}, got {value!r}")
            elif name in ("window", "ngram", "guesses", "lookup"):
                built = getattr(settings, name)
                lowest = 0 if name in ("guesses", "lookup") else 1
                if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= built:
                    raise SpecbuildError(
                        f"drafting option {name} must be an integer from {lowest} to {built} (the engine's), got "
                        f"{value!r}"
                    )
            else:
                raise SpecbuildError(
                    f"drafting option {name!r} is not one of window, ngram, guesses, lookup, pool (lookahead)"
                )
            fields[name] = value
        return dataclasses.replace(settings, **fields)

    def __init__(self, settings: LookaheadSettings, prompt: Sequence[int], sampling=None):
        super().__init__(settings, prompt, sampling)
        self.w, self.n, self.g = settings.window, settings.ngram, settings.guesses
        self.pool = NgramPool(self.g)
        prompt = [int(t) for t in prompt]
        self.lookup = settings.lookup
        self.index = ContextIndex(LOOKUP_NGRAM, prompt) if self.lookup > 0 else None
        if settings.pool != "window":  # earlier n-grams first: the most recent occurrence is kept
            for start in range(max(0, len(prompt) - self.n + 1)):
                self.pool.add(prompt[start], tuple(prompt[start + 1 : start + self.n]))
        self._tail = prompt[len(prompt) - self.n + 1 :] if self.n > 1 else []  # the context's last N - 1 tokens
        rng = np.random.default_rng(WINDOW_SEED)
        picks = rng.integers(len(prompt), size=self.w - 1) if prompt else np.zeros(self.w - 1, dtype=np.int64)
        # the window: level 0 holds columns 1..W-1, every other level columns 0..W-1
        self.levels: list[list[int]] = [[prompt[i] if prompt else 0 for i in picks]]
        self._root = 0  # the last call's root (row 0, column 0)
        self._last_level_rows: np.ndarray | None = None  # the last call's rows of the window's last level
        self._size = 0  # the last call's tokens

    def propose(self, step: StepResult) -> Proposal:
        top = step.outputs.get(ef.ROW_TOP_TOKENS) if step.nodes is not None else None
        if self._last_level_rows is not None and top is not None and top.shape[1] == self._size:
            self._advance(top[0, self._last_level_rows].tolist())
        self._last_level_rows = None
        if self.settings.pool == "context" and self.n > 1:
            self._observe(step.tokens)
        root = step.tokens[-1]
        copied = self._looked_up(step.tokens)
        guesses = self.pool.get(root)[: self.g] if self.n > 1 else []
        verify = Proposal.from_continuations(root, [*copied, *guesses])
        if copied or self.n <= 1:
            self._size = verify.size
            return verify
        proposal, self._last_level_rows = self._with_window(verify)
        self._root, self._size = root, proposal.size
        return proposal

    def _looked_up(self, accepted: list[int]) -> list[list[int]]:
        """The context's continuation of its longest earlier match of the latest tokens (at most L, as many tokens
        as matched), or none."""
        if self.index is None:
            return []
        self.index.observe(accepted)
        return self.index.continuations(lambda matched: min(self.lookup, matched))

    def _observe(self, accepted: list[int]) -> None:
        """The n-grams that end at the newly committed tokens go to the pool."""
        tail = self._tail
        for token in accepted:
            tail.append(int(token))
            if len(tail) == self.n:
                self.pool.add(tail[0], tuple(tail[1:]))
                del tail[0]

    def _advance(self, newest: list[int]) -> None:
        """The last call's argmaxes of the window's last level (W tokens) become its next level (see the module)."""
        levels = self.levels
        if len(levels) < self.n - 1:  # warming up: one more level
            levels.append(newest)
            return
        row0 = [self._root, *levels[0]]
        for i in range(self.w):
            self.pool.add(row0[i], (*(level[i] for level in levels[1:]), newest[i]))
        following = [*levels[1:], newest]
        self.levels = [following[0][1:], *following[1:]]

    def _with_window(self, verify: Proposal) -> tuple[Proposal, np.ndarray]:
        """The verification tree followed by the window's rows; also the rows of the window's last level."""
        v, w = verify.size, self.w
        cells = [(0, i) for i in range(1, w)] + [(lv, i) for lv in range(1, len(self.levels)) for i in range(w)]
        size = v + len(cells)
        mask = np.zeros((size, size), dtype=np.bool_)
        mask[:v, :v] = verify.mask[0]
        offsets = np.empty(size, dtype=np.int64)
        offsets[:v] = verify.offsets
        tokens = np.empty(size, dtype=np.int64)
        tokens[:v] = verify.tokens[0]
        row_of = {(0, 0): 0}  # the root is row 0's column 0
        for k, (level, column) in enumerate(cells):
            row = v + k
            row_of[level, column] = row
            tokens[row] = self.levels[level][column - 1 if level == 0 else column]
            offsets[row] = column + level
            mask[row, 0] = True
            for c in range(1, column + 1):  # row 0 up to this column
                mask[row, row_of[0, c]] = True
            for lv in range(1, level + 1):  # this column of levels 1..level
                mask[row, row_of[lv, column]] = True
        last = len(self.levels) - 1
        last_rows = np.array([row_of[last, i] for i in range(w)], dtype=np.int64)
        return Proposal(tokens[None], mask[None], offsets, verify.paths), last_rows
