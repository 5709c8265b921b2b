"""Token recycling's drafter (numpy): the candidate table, and each step's tree drawn from it.

After every call the graph returns, for each row it verified, the model's top K next tokens (ef.ROW_TOP_K): those
rows' tokens get them as their candidates in the table (int32 [V, K], the latest call's kept; -1: never seen), every
verified row, accepted or not -- the prompt's last rows after a prefill (arXiv:2408.08696, "adjacency matrix"). The
next tree is the engine's static tree of ranks (engine.yaml `mode.drafter.choices`): node (r1, ..., rd) takes
candidate rd of its parent's token, level by level; a node whose parent's token has no candidates yet is left out
with its subtree (so a cold table verifies fewer rows, never guesses).

The table is shared by the requests of one tenant (serve's API key; everyone's without keys), like suffix decoding's
pool (docs/modes.md: what one client's traffic teaches must not time another's), and lives as long as the process.
Host work per step is O(tree size); acceptance is the graph's (greedy exact; drafts are point masses, so sampling
keeps the target distribution).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.manifest import ListOf, check_fields, integer
from specbuild.tree import Tree


class CandidateTable:
    """K candidate next tokens per vocabulary entry, most likely first: int32 [V, K], -1 where none is known."""

    def __init__(self, vocab_size: int, top_k: int):
        self.table = np.full((vocab_size, top_k), -1, dtype=np.int32)

    def update(self, tokens: np.ndarray, top: np.ndarray) -> None:
        """tokens [N] get top [N, K] (a token verified twice in one call keeps its last row's)."""
        self.table[tokens] = top

    @property
    def known(self) -> int:
        """Tokens that have candidates."""
        return int((self.table[:, 0] >= 0).sum())


class TableSet:
    """The tables of one engine: one per tenant, made on its first request."""

    def __init__(self, vocab_size: int, top_k: int):
        self.vocab_size, self.top_k = vocab_size, top_k
        self._tables: dict[str | None, CandidateTable] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str | None) -> CandidateTable:
        with self._lock:
            table = self._tables.get(tenant)
            if table is None:
                table = self._tables[tenant] = CandidateTable(self.vocab_size, self.top_k)
            return table


@dataclasses.dataclass(frozen=True)
class RecycleSettings:
    """engine.yaml `mode.drafter` (RecycleDrafter.SCHEMA), and the engine's tables."""

    top_k: int
    tree: Tree
    tables: TableSet = dataclasses.field(compare=False)
    table: CandidateTable = dataclasses.field(compare=False)  # the table of this request's tenant


@dataclasses.dataclass(frozen=True)
class _Levels:
    """The static tree level by level: per depth, its nodes, their parents and the rank each takes."""

    nodes: list[np.ndarray]
    parents: list[np.ndarray]
    ranks: list[np.ndarray]


@functools.lru_cache(maxsize=16)
def _levels(tree: Tree) -> _Levels:
    depths, parents = tree.depths, tree.parents
    ranks = np.array([0, *(c[-1] for c in tree.choices)], dtype=np.int64)
    at = [np.flatnonzero(depths == d) for d in range(1, tree.depth + 1)]
    return _Levels(at, [parents[n] for n in at], [ranks[n] for n in at])


@functools.lru_cache(maxsize=512)
def _subtree(choices: tuple) -> Tree:
    return Tree.from_choices(list(choices))


class RecycleDrafter(Drafter):
    SCHEMA = {
        "mode": {
            "drafter": {
                "top_k": integer(1),
                "depth": integer(1),
                "choices": ListOf(ListOf(integer(0), min_len=1)),
            }
        }
    }

    @classmethod
    def read_settings(cls, manifest: dict, source: str = "engine.yaml") -> RecycleSettings:
        check_fields(manifest, cls.SCHEMA, source)
        fields = manifest["mode"]["drafter"]
        tree = Tree.from_choices(fields["choices"], source=f"{source}: field mode.drafter.choices")
        k = fields["top_k"]
        if any(rank >= k for choice in tree.choices for rank in choice):
            raise SpecbuildError(f"{source}: field mode.drafter.choices takes a rank >= top_k {k}")
        tables = TableSet(manifest["model"]["vocab_size"], k)
        return RecycleSettings(k, tree, tables, tables.get(None))

    @classmethod
    def for_tenant(cls, settings: RecycleSettings, tenant: str | None) -> RecycleSettings:
        """The tenant's own table."""
        if tenant is None:
            return settings
        return dataclasses.replace(settings, table=settings.tables.get(tenant))

    def __init__(self, settings: RecycleSettings, prompt: Sequence[int], sampling=None):
        super().__init__(settings, prompt, sampling)
        self.table = settings.table
        self.tree = settings.tree
        self.levels = _levels(settings.tree)
        self._prompt_tail = np.asarray(prompt[-settings.tree.size :], dtype=np.int64)  # a prefill's window rows
        self._verified: np.ndarray | None = None  # the tokens the last call verified, root first

    def propose(self, step: StepResult) -> Proposal:
        top = step.outputs.get(ef.ROW_TOP_K)
        if top is not None:
            rows = top[0]  # [N, K]: the window rows of this sequence
            if step.nodes is None:  # a prefill: the prompt's last N tokens
                tokens = self._prompt_tail[max(0, len(self._prompt_tail) - len(rows)) :]
            else:  # the proposal's first N nodes (all of it, or what the scheduler cut it to)
                tokens = self._verified[: len(rows)] if self._verified is not None else rows[:0, 0]
            if len(tokens) == len(rows):
                self.table.update(tokens, rows)
        proposal = self.draft(step.tokens[-1])
        self._verified = proposal.tokens[0]
        return proposal

    def draft(self, root: int) -> Proposal:
        """The static tree's tokens from the table; nodes under a token without candidates left out."""
        tree, table = self.tree, self.table.table
        tokens = np.empty(tree.size, dtype=np.int64)
        tokens[0] = root
        levels = self.levels
        for nodes, parents, ranks in zip(levels.nodes, levels.parents, levels.ranks):
            parent = tokens[parents]
            tokens[nodes] = np.where(parent >= 0, table[np.maximum(parent, 0), ranks], -1)
        known = tokens >= 0
        if known.all():
            return Proposal.from_tree(tokens, tree)
        kept = np.flatnonzero(known)  # parents before children: a prefix-closed subset, in the tree's node order
        return Proposal.from_tree(tokens[kept], _subtree(tuple(tree.choices[i - 1] for i in kept[1:])))
