"""Token recycling's drafter (numpy): the candidate table, and each step's tree drawn from it.

After every call the graph returns, for each row it verified, the model's top K next tokens (ef.ROW_TOP_K): those
rows' tokens get them as their candidates in the table (int32 [V, K], the latest call's kept; -1: never seen), every
verified row, accepted or not -- the prompt's last rows after a prefill (arXiv:2408.08696, "adjacency matrix"). The
next tree is the engine's static tree of ranks (engine.yaml `mode.drafter.choices`): node (r1, ..., rd) takes
candidate rd of its parent's token, level by level; a node whose parent's token has no candidates yet is left out
with its subtree (so a cold table verifies fewer rows, never guesses). With `context: pair` a node's candidates are
those of the pair (its parent's parent's token, its parent's token) where that pair was verified before -- a hash
table beside the token table, updated from the same rows -- and its parent's token's otherwise.

The scheduler's budget sizes the tree: the drafter ranks the static tree's nodes by their chance of being accepted
(each at most its parent's, so every first few are a tree) and prices each cut by those chances (a tree's expected
tokens = 1 + the sum over its nodes, as EAGLE-2 and Sequoia size trees); the scheduler compares the prices with the
calls' measured cost and the drafter proposes the best nodes it allows. The chances are learnt per node from whole
trees, whatever the budget verified: a cut proposal is drafted from the whole tree once in SHADOW_EVERY steps, and
that tree is compared with the tokens the sequence emits next (`_Shadow`: what verifying it would have accepted), so
nodes a cut leaves out keep being priced by what they would give (never starved by an early cut). They start from
the rank profile the static tree was chosen by.

With `copy` (engine.yaml; the default of new engines), the continuation of the latest tokens' longest earlier match
in the request's own prompt and output (runtime/context_index.py, prompt lookup) is grafted onto each step's tree,
first and as many tokens as the match is long (up to `copy`): text that repeats its context is drafted as `ngram`
drafts it, the rest from the table. The budget prices the table's nodes; alone a copy is drafted whole within the
step (it costs nothing to make, and a lone call verifies what it is given); in a batch within the budget (the plan
verifies a tree whole or its root alone), or, where the budget is the root alone, the copy alone: a chain, which the
plan cuts to what pays, as it cuts `ngram`'s.

The table (and the nodes' chances) are shared by the requests of one tenant (serve's API key; everyone's without
keys), like suffix decoding's pool (docs/modes.md: what one client's traffic teaches must not time another's), and
live as long as the process.
Host work per step is O(tree size + accepted tokens); acceptance is the graph's (greedy exact; drafts are point
masses, so sampling keeps the target distribution).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.plugins.recycle import CONTEXTS, COPY_NGRAM, PAIR_SLOTS, RANK_PROFILE
from specbuild.runtime.context_index import ContextIndex
from specbuild.runtime.drafter import Drafter, Proposal, StepResult, cached_tree
from specbuild.runtime.manifest import ListOf, check_fields, integer, one_of
from specbuild.tree import Tree

HOST_MS_PER_DRAFT = 0.02  # what a draft token costs the host (a 10-node tree with pairs: ~0.2 ms, measured)
NODE_EMA = 0.03  # weight of one whole tree's outcome in a node's running chance of being accepted
# a proposal cut by the budget is drafted from the whole tree once in this many steps, that tree compared with what
# the sequence emits next (a tree's host work, ~0.2 ms, is paid on a quarter of the cut steps)
SHADOW_EVERY = 4


class CandidateTable:
    """K candidate next tokens per vocabulary entry, most likely first: int32 [V, K], -1 where none is known; with
    `pair_slots`, also per pair (token before, token) in a direct-mapped hash of that many slots (a newer pair
    overwrites an older one in its slot: bounded memory, O(1) per row). Beside them, what its trees taught of the
    static tree's nodes (`RecycleDrafter._feed`), starting from `prior`, and their ranking while that holds."""

    def __init__(self, vocab_size: int, top_k: int, prior: np.ndarray, pair_slots: int = 0):
        self.vocab_size = vocab_size
        self.table = np.full((vocab_size, top_k), -1, dtype=np.int32)
        self.pair_slots = pair_slots
        self.pair_keys = np.full(pair_slots, -1, dtype=np.int64)
        self.pair_top = np.zeros((pair_slots, top_k), dtype=np.int32)
        self.accept = prior.copy()  # per node of the static tree: its chance of being accepted when drafted
        self.held = np.ones(len(prior))  # per node of the static tree: its chance of being drafted
        self.rankings: dict[bool, tuple[tuple, np.ndarray]] = {}  # RecycleDrafter.ranked's, until the chances move

    def _slot(self, keys: np.ndarray) -> np.ndarray:
        mixed = keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing
        return (mixed >> np.uint64(64 - self.pair_slots.bit_length() + 1)).astype(np.int64)

    def update(self, tokens: np.ndarray, top: np.ndarray, before: np.ndarray | None = None) -> None:
        """tokens [N] get top [N, K] (a token verified twice in one call keeps its last row's); with `before` [N]
        (the token before each, -1: none), so do the pairs."""
        self.table[tokens] = top
        if self.pair_slots and before is not None:
            known = before >= 0
            keys = before[known] * self.vocab_size + tokens[known]
            slots = self._slot(keys)
            self.pair_keys[slots] = keys
            self.pair_top[slots] = top[known]

    def candidates(self, before: np.ndarray, tokens: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """The rank-th candidate after each token (-1: none known): the pair's (before, token) where it is known."""
        out = self.table[tokens, ranks]
        if self.pair_slots:
            keys = before * self.vocab_size + tokens
            slots = self._slot(keys)
            hit = (self.pair_keys[slots] == keys) & (before >= 0)
            out = np.where(hit, self.pair_top[slots, ranks], out)
        return out

    @property
    def known(self) -> int:
        """Tokens that have candidates."""
        return int((self.table[:, 0] >= 0).sum())


class TableSet:
    """The tables of one engine: one per tenant, made on its first request."""

    def __init__(self, vocab_size: int, top_k: int, prior: np.ndarray, pair_slots: int = 0):
        self.vocab_size, self.top_k, self.prior, self.pair_slots = vocab_size, top_k, prior, pair_slots
        self._tables: dict[str | None, CandidateTable] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str | None) -> CandidateTable:
        with self._lock:
            table = self._tables.get(tenant)
            if table is None:
                table = self._tables[tenant] = CandidateTable(self.vocab_size, self.top_k, self.prior, self.pair_slots)
            return table

    def memory(self) -> tuple[int, int]:
        """The bytes the tables hold, and their bound: the same (each table's arrays are made whole)."""
        with self._lock:
            held = sum(t.table.nbytes + t.pair_keys.nbytes + t.pair_top.nbytes for t in self._tables.values())
        return held, held


@dataclasses.dataclass(frozen=True)
class RecycleSettings:
    """engine.yaml `mode.drafter` (RecycleDrafter.SCHEMA), and the engine's tables."""

    top_k: int
    tree: Tree
    context: str  # CONTEXTS: candidates per token, or per (token before, token) where the pair is known
    tables: TableSet = dataclasses.field(compare=False)
    table: CandidateTable = dataclasses.field(compare=False)  # the table of this request's tenant
    node_of: dict = dataclasses.field(compare=False)  # choice -> its node in `tree`
    copy: int = 0  # longest continuation of the context's match grafted onto the tree (0: none)


@dataclasses.dataclass(frozen=True)
class _Levels:
    """The static tree level by level: per depth, its nodes, their parents, their parents' parents (-1: the token
    before the root) and the rank each takes."""

    nodes: list[np.ndarray]
    parents: list[np.ndarray]
    grandparents: list[np.ndarray]
    ranks: list[np.ndarray]


@functools.lru_cache(maxsize=64)
def _levels(tree: Tree) -> _Levels:
    depths, parents = tree.depths, tree.parents
    ranks = np.array([0, *(c[-1] for c in tree.choices)], dtype=np.int64)
    grand = np.where(parents > 0, parents[np.maximum(parents, 0)], -1)
    at = [np.flatnonzero(depths == d) for d in range(1, tree.depth + 1)]
    return _Levels(at, [parents[n] for n in at], [grand[n] for n in at], [ranks[n] for n in at])


def _static_nodes(tree: Tree, node_of: dict) -> np.ndarray:
    """The static tree's node of each node of `tree` (a cut of it; root: 0)."""
    return np.array([0, *(node_of[c] for c in tree.choices)], dtype=np.int64)


class _Shadow:
    """A whole tree drafted at a step (its root-to-leaf paths of (token, static node)), compared with the tokens its
    sequence emits next until one differs or the deepest is matched: the nodes verifying it would have accepted."""

    def __init__(self, paths: list[tuple[tuple[int, int], ...]]):
        self.paths, self.matched = paths, 0
        self.depth = max((len(p) for p in paths), default=0)
        self.nodes = np.array(sorted({node for p in paths for _, node in p}), dtype=np.int64)  # the nodes it held

    @classmethod
    def of(cls, proposal: Proposal, nodes: np.ndarray) -> _Shadow:
        """nodes: the static tree's node of each of the proposal's."""
        tokens = proposal.tokens[0]
        paths = {tuple((int(tokens[n]), int(nodes[n])) for n in row[1:] if n >= 0) for row in proposal.paths[0]}
        paths.discard(())
        return cls(sorted(paths))

    def feed(self, token: int) -> bool:
        """Advance by one emitted token; True when the outcome is known."""
        if self.matched >= self.depth:
            return True
        paths = [p for p in self.paths if len(p) > self.matched and p[self.matched][0] == token]
        if not paths:
            return True
        self.paths, self.matched = paths, self.matched + 1
        return self.matched >= self.depth

    def hits(self) -> set[int]:
        """The static nodes matched (those on the matched path)."""
        return {p[d][1] for p in self.paths for d in range(min(self.matched, len(p)))}


def _restrict(proposal: Proposal, before: np.ndarray, nodes: np.ndarray, keep: np.ndarray, tree: Tree):
    """The proposal's nodes among the static nodes `keep` (a prefix-closed cut of `tree`), and their tokens before."""
    kept = np.flatnonzero(np.isin(nodes, keep))
    subtree = cached_tree(tuple(tree.choices[n - 1] for n in nodes[kept][1:]))
    return Proposal.from_tree(proposal.tokens[0][kept], subtree), before[kept]


def _graft(proposal: Proposal, before_root: int, copy: list[int], limit: int) -> tuple[Proposal, np.ndarray]:
    """`copy` as a chain from the proposal's root, then the proposal's nodes in their order, merged by shared prefix
    (Proposal.from_continuations: no row twice), at most `limit` nodes; and the token before each node (the root's:
    `before_root`). The copy comes first: where the context has a match, its continuation is the likelier draft."""
    tokens, parents = proposal.tokens[0].tolist(), proposal.parents().tolist()
    paths: list[tuple] = [()]  # each node's tokens from the root (excluded), parents before children
    for token, parent in zip(tokens[1:], parents[1:]):
        paths.append((*paths[parent], token))
    grafted = Proposal.from_continuations(tokens[0], [copy, *paths[1:]], limit)
    return grafted, np.concatenate([[before_root], grafted.tokens[0][grafted.parents()[1:]]])


class RecycleDrafter(Drafter):
    # the scheduler's budget sizes the tree, alone too: a tree of rows does not pay where rows are dear (int4 on most
    # CPUs) nor under load, and a tree the step would cut to its root is not drafted at all
    paid_drafts = True
    SCHEMA = {
        "mode": {
            "drafter": {
                "top_k": integer(1),
                "depth": integer(1),
                "choices": ListOf(ListOf(integer(0), min_len=1)),
                "context": one_of(CONTEXTS, optional=True),
                "copy": integer(0, optional=True),
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
        context = fields.get("context", "token")
        node_of = {choice: i + 1 for i, choice in enumerate(tree.choices)}
        prior = np.ones(tree.size)  # per node: its rank profile product (the chances before any tree was seen)
        for choice, node in node_of.items():
            prior[node] = np.prod([RANK_PROFILE[min(r, len(RANK_PROFILE) - 1)] for r in choice])
        tables = TableSet(manifest["model"]["vocab_size"], k, prior, PAIR_SLOTS if context == "pair" else 0)
        return RecycleSettings(k, tree, context, tables, tables.get(None), node_of, fields.get("copy", 0))

    @classmethod
    def for_tenant(cls, settings: RecycleSettings, tenant: str | None) -> RecycleSettings:
        """The tenant's own table."""
        if tenant is None:
            return settings
        return dataclasses.replace(settings, table=settings.tables.get(tenant))

    @classmethod
    def forget_traffic(cls, settings: RecycleSettings) -> RecycleSettings:
        """New, empty tables."""
        old = settings.tables
        tables = TableSet(old.vocab_size, old.top_k, old.prior, old.pair_slots)
        return dataclasses.replace(settings, tables=tables, table=tables.get(None))

    @classmethod
    def learnt_memory(cls, settings: RecycleSettings) -> tuple[int, int]:
        return settings.tables.memory()

    def __init__(self, settings: RecycleSettings, prompt: Sequence[int], sampling=None):
        super().__init__(settings, prompt, sampling)
        self.table = settings.table
        self.tree = settings.tree
        tail = [-1, *prompt[-settings.tree.size :]]
        self._prompt_tail = np.asarray(tail, dtype=np.int64)  # a prefill's window rows, after the token before them
        self._before_root = int(prompt[-1]) if prompt else -1  # the token before the next root
        self._verified: np.ndarray | None = None  # the tokens the last call verified, root first
        self._verified_before: np.ndarray | None = None  # the token before each of them
        self._shadows: list[_Shadow] = []  # whole trees drafted, compared with the tokens emitted since
        self._steps = 0
        # the request's tokens, to draft copies from (settings.copy > 0)
        self.index = ContextIndex(COPY_NGRAM, prompt) if settings.copy else None

    def propose(self, step: StepResult) -> Proposal:
        top = step.outputs.get(ef.ROW_TOP_K)
        if top is not None:
            rows = top[0]  # [N, K]: the window rows of this sequence
            if step.nodes is None:  # a prefill: the prompt's last N tokens
                start = max(1, len(self._prompt_tail) - len(rows))
                tokens, before = self._prompt_tail[start:], self._prompt_tail[start - 1 : -1]
            elif self._verified is not None:  # the proposal's first N nodes (all of it, or what the scheduler cut)
                tokens, before = self._verified[: len(rows)], self._verified_before[: len(rows)]
            else:
                tokens = before = rows[:0, 0]
            if len(tokens) == len(rows):
                self.table.update(tokens, rows, before)
        if len(step.tokens) > 1:  # the token before the new root: an accepted one, or the last root
            self._before_root = int(step.tokens[-2])
        elif step.nodes is not None and self._verified is not None:
            self._before_root = int(self._verified[0])
        if step.nodes is not None:
            self._feed(step.tokens)
        cut = self.tree
        if self.limit is not None and self.limit < cut.size:  # the scheduler's budget: the best nodes only
            cut = cached_tree(self.ranked()[0][: self.limit - 1])  # ranked is prefix-closed: a tree
        whole = cut is self.tree or self._steps % SHADOW_EVERY == 0  # draft the whole tree, to learn from
        self._steps += 1
        drafted = self.tree if whole else cut
        proposal, self._verified_before, nodes = self.draft(step.tokens[-1], self._before_root, drafted)
        if whole:
            self._shadows.append(_Shadow.of(proposal, nodes))
            if cut is not self.tree:
                keep = _static_nodes(cut, self.settings.node_of)
                proposal, self._verified_before = _restrict(proposal, self._verified_before, nodes, keep, self.tree)
        if self.index is not None:
            proposal, self._verified_before = self._with_copy(proposal, self._verified_before, step.tokens)
        self._verified = proposal.tokens[0]
        return proposal

    def draft_ms(self) -> float:
        return HOST_MS_PER_DRAFT

    def _with_copy(self, proposal: Proposal, before: np.ndarray, accepted: list[int]) -> tuple[Proposal, np.ndarray]:
        """The continuation of the context's best earlier match, as many tokens as the match is long up to the
        settings' `copy`, grafted onto `proposal` (`_graft`) in as many nodes as the budget allows or the copy needs,
        within the engine's step; and the token before each node. No match: `proposal` as it is."""
        self.index.observe(accepted)
        found = self.index.continuations(lambda matched: min(self.settings.copy, matched))
        if not found:
            return proposal, before
        copy = found[0]
        if self.limit is None:
            nodes = self.tree.size
        elif self.batched:  # a batch's plan verifies a tree whole or its root alone: the copy within the budget,
            nodes = self.limit if self.limit > 1 else 1 + len(copy)  # or alone, a chain the plan can cut
        else:  # alone a copy is verified whole, as `ngram`'s (it costs nothing to make)
            nodes = max(self.limit, 1 + len(copy))
        nodes = min(nodes, self.tree.size)
        if nodes <= 1:
            return proposal, before
        return _graft(proposal, self._before_root, copy, nodes)

    def _feed(self, emitted: list[int]) -> None:
        """Compare the whole trees drafted so far with the tokens this step emitted; each whose outcome is known
        teaches the nodes it held: a hit where verifying that tree would have accepted it, a miss otherwise; a node
        left out for want of candidates learns nothing of that (it would have cost no row alone), only that it was
        not drafted (in a batch its row is padding all the same)."""
        alive, table = [], self.table
        for shadow in self._shadows:
            if any(shadow.feed(token) for token in emitted):
                held = shadow.nodes
                table.accept[held] += NODE_EMA * (np.isin(held, list(shadow.hits())) - table.accept[held])
                drafted = np.zeros(len(table.held))
                drafted[held] = 1.0
                table.held[1:] += NODE_EMA * (drafted[1:] - table.held[1:])
                table.rankings.clear()
            else:
                alive.append(shadow)
        self._shadows = alive

    def ranked(self, padded: bool = False) -> tuple[tuple, np.ndarray]:
        """The static tree's choices, most likely accepted first, and those chances: each node's learnt chance, at
        most its parent's (a child is only accepted with its parent), parents first on ties; so that every first
        few of them are a tree (prefix-closed). padded: the chance of a node being drafted and accepted (a batch
        pads the rows of nodes left out), else of being accepted when drafted (alone a call has no row for it). Kept
        on the table until its chances move: every sequence of a step reads the same one."""
        kept = self.table.rankings.get(padded)
        if kept is not None:
            return kept
        tree, value = self.tree, self.table.accept.copy()
        if padded:
            value *= self.table.held
        value[0] = 1.0
        levels = _levels(tree)
        for nodes, parents in zip(levels.nodes, levels.parents):
            value[nodes] = np.minimum(value[nodes], value[parents])
        ranked = np.lexsort((np.arange(tree.size), tree.depths, -value))[1:]  # the root first, then left out
        kept = self.table.rankings[padded] = (tuple(tree.choices[n - 1] for n in ranked), value[ranked])
        return kept

    def expected_tokens(self, longest: int, padded: bool = False) -> tuple[float, ...]:
        """Tokens a row verifying the best t - 1 nodes is expected to give, t = 1..longest: 1 + the sum of their
        chances of being accepted (`ranked`; beyond the whole tree: the whole tree's)."""
        gains = 1.0 + np.concatenate([[0.0], np.cumsum(self.ranked(padded)[1])])
        if longest > len(gains):
            gains = np.concatenate([gains, np.full(longest - len(gains), gains[-1])])
        return tuple(gains[:longest].tolist())

    def draft(
        self, root: int, before_root: int = -1, tree: Tree | None = None
    ) -> tuple[Proposal, np.ndarray, np.ndarray]:
        """The static tree's (or `tree`'s) tokens from the table (nodes under a token without candidates left out),
        the token before each node (its parent's; the root's: `before_root`) and each node's node in the static
        tree."""
        tree = tree or self.tree
        levels = _levels(tree)
        ext = np.empty(tree.size + 1, dtype=np.int64)  # ext[0]: the token before the root; ext[i + 1]: node i's
        ext[0], ext[1] = before_root, root
        for nodes, parents, grand, ranks in zip(levels.nodes, levels.parents, levels.grandparents, levels.ranks):
            parent = ext[parents + 1]
            found = self.table.candidates(ext[grand + 1], np.maximum(parent, 0), ranks)
            ext[nodes + 1] = np.where(parent >= 0, found, -1)
        tokens = ext[1:]
        before = ext[tree.parents + 1]
        nodes = _static_nodes(tree, self.settings.node_of)
        known = tokens >= 0
        if known.all():
            return Proposal.from_tree(tokens, tree), before, nodes
        kept = np.flatnonzero(known)  # parents before children: a prefix-closed subset, in the tree's node order
        subtree = cached_tree(tuple(tree.choices[i - 1] for i in kept[1:]))
        return Proposal.from_tree(tokens[kept], subtree), before[kept], nodes[kept]
