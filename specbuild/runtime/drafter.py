"""What the generation loop asks of a mode: a drafter proposes the tree the next engine call verifies.

The loop is propose -> verify/accept (one engine call) -> commit, for every mode:
- every call (prefill included) is decoded once, by the session, into a `StepResult`: the accepted tokens, the
  accepted nodes and the graph's raw outputs; the loop, the drafter and streaming all read that one result;
- `Drafter.propose(step)` returns a `Proposal` after `step`: the tokens to verify (the root -- the last accepted
  token, not yet in the KV cache -- then the drafts) and their tree (ancestor mask, position offsets, root-to-leaf
  paths).
A drafter class reads and checks its settings in engine.yaml once, when the engine loads (`read_settings`); each
sequence gets its own drafter, built from those settings and its prompt.

Modes whose step graph drafts the next tree (Medusa, EAGLE) use GraphDrafter, which reads the graph's outputs;
host-drafted modes (n-gram) compute proposals themselves. Drafters are numpy only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.tree import Tree


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One engine call, decoded once. tokens: the accepted tokens (accepted drafts + the bonus token; the last one is
    the next tree's root). nodes: which of the call's new tokens they are, in order (None after prefill: all of
    them). outputs: the graph's raw outputs by name (the next draft for graph drafters, logits)."""

    tokens: list[int]
    nodes: np.ndarray | None
    outputs: Mapping[str, np.ndarray]

    @property
    def drafted(self) -> bool:
        """Whether the call drafted this sequence's next tree (the next-tree outputs have one row per drafted row:
        none after a call with ef.DRAFT_ROWS empty)."""
        return len(self.outputs[ef.NEXT_INPUT_IDS]) > 0


@dataclasses.dataclass
class Proposal:
    """What one engine call verifies: tokens [1,N] (root first), mask [1,N,N] (bool, node i sees node j),
    offsets [N] (depth = position offset from the root), paths [1,NP,DP] (node indices, -1 padded). Every draft is
    verified as a point mass (builder/network/acceptance.py): a drafter that samples draws each draft with the uniform
    number of the position it would take (sampling.position_uniforms)."""

    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    paths: np.ndarray

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])

    def root_only(self) -> Proposal:
        """The root alone (near the end of the cache)."""
        return Proposal.root(int(self.tokens[0, 0]))

    def parents(self) -> np.ndarray:
        """Each node's parent (the root's: 0): its ancestor one level up."""
        return (self.mask[0] & (self.offsets[None, :] == self.offsets[:, None] - 1)).argmax(1)

    def chain_prefix(self, tokens: int) -> Proposal:
        """The first `tokens` tokens of a chain (a proposal whose node i sits at depth i)."""
        offsets = self.offsets[:tokens]
        return Proposal(self.tokens[:, :tokens], self.mask[:, :tokens, :tokens], offsets, offsets[None, None])

    @classmethod
    def root(cls, token: int) -> Proposal:
        """`token` alone: plain decoding."""
        return cls(
            np.array([[token]], dtype=np.int64),
            np.ones((1, 1, 1), dtype=np.bool_),
            np.zeros(1, dtype=np.int64),
            np.zeros((1, 1, 1), dtype=np.int64),
        )

    @classmethod
    def chain(cls, tokens) -> Proposal:
        """`tokens` (root first) as a chain: node i at depth i sees nodes 0..i."""
        n = len(tokens)
        offsets = np.arange(n, dtype=np.int64)
        mask = np.tril(np.ones((n, n), dtype=np.bool_))[None]
        return cls(np.asarray(tokens, dtype=np.int64).reshape(1, -1), mask, offsets, offsets[None, None])

    @classmethod
    def from_continuations(
        cls, root: int, continuations: Sequence[Sequence[int]], limit: int | None = None
    ) -> Proposal:
        """The tree of `continuations` of `root` merged by shared prefix (a trie; siblings in order of first
        appearance), every continuation a root-to-node path; one continuation is a chain. limit: at most this many
        nodes (root included), taken in the continuations' order (the rest of a continuation that finds no room is
        left out)."""
        if len(continuations) <= 1:
            drafts = list(continuations[0]) if continuations else []
            return cls.chain([root, *drafts][:limit])
        children: dict[tuple, dict[int, int]] = {}  # path of ranks -> {token: rank of the child}
        token_of: dict[tuple, int] = {(): root}
        for continuation in continuations:
            path: tuple = ()
            for token in continuation:
                ranks = children.setdefault(path, {})
                if int(token) not in ranks and limit is not None and len(token_of) >= limit:
                    break
                path = (*path, ranks.setdefault(int(token), len(ranks)))
                token_of[path] = int(token)
        tree = cached_tree(tuple(sorted(p for p in token_of if p)))
        tokens = [0] * tree.size
        for path, token in token_of.items():
            tokens[tree.node_index(path)] = token
        return cls.from_tree(tokens, tree)

    @classmethod
    def from_tree(cls, tokens, tree: Tree) -> Proposal:
        return cls(
            np.asarray(tokens, dtype=np.int64).reshape(1, -1), tree.ancestor_mask[None], tree.depths, tree.paths[None]
        )


@functools.lru_cache(maxsize=512)
def cached_tree(choices: tuple) -> Tree:
    """The Tree of `choices` (a tuple of rank tuples), made once per distinct set (host drafters' trees repeat)."""
    return Tree.from_choices(list(choices))


class Drafter:
    """One sequence's drafter. `read_settings` reads the mode's part of engine.yaml once per engine (under `mode`).

    A drafter whose drafts cost time to make (`paid_drafts`: a draft model's calls), or whose drafts are only worth
    their rows in part (token recycling's fixed tree), drafts at most `limit` - 1 of those tokens when the scheduler
    sets `limit` (what its cost model would verify at the step's batch size; `batched`: that step holds other
    sequences too), and reports what a draft token costs it (`draft_ms`). Drafts that cost nothing (a copy of the
    context) it may add as an unpaid drafter proposes them: a lone call verifies what it is given, a batch's plan
    cuts a chain to what pays and verifies a tree whole or its root alone."""

    paid_drafts = False
    limit: int | None = None
    batched: bool = False

    def draft_ms(self) -> float:
        """Milliseconds one draft token costs to make (0: drafting is free next to an engine call)."""
        return 0.0

    def expected_tokens(self, longest: int, padded: bool = False) -> tuple[float, ...] | None:
        """A paid drafter whose proposal cut to its first t tokens is one of its own (a best-first tree): the tokens
        a row verifying that cut is expected to give, t = 1..longest (runtime/speculation.Shape.gains); padded: in a
        batch, where a row the drafter could not fill is padding. None: the scheduler prices the cut as a chain, with
        the acceptance it learnt per depth."""
        return None

    @classmethod
    def load_settings(cls, engine) -> Any:
        """The drafting settings of a loaded engine (runtime/engine.Engine), once per engine: `read_settings` of its
        engine.yaml, or more (a draft model's own engine)."""
        return cls.read_settings(engine.manifest, str(engine.path / ef.ENGINE_MANIFEST))

    @classmethod
    def read_settings(cls, manifest: dict, source: str = "engine.yaml") -> Any:
        """The drafting settings, read and checked once when the engine loads (SpecbuildError naming the field)."""
        return None

    @classmethod
    def narrowed(cls, settings: Any, options: Mapping[str, Any]) -> Any:
        """The settings of one request that asks for `options` (its own, smaller drafting settings; at most what the
        engine was built for), checked: SpecbuildError naming the option. Modes without such options refuse any."""
        if options:
            raise SpecbuildError(f"drafting option {next(iter(options))!r}: this engine's mode takes none")
        return settings

    @classmethod
    def for_tenant(cls, settings: Any, tenant: str | None) -> Any:
        """The settings of a request made for `tenant` (Request.tenant: serve's API key, hashed; None: anyone). A
        drafter that learns from traffic keeps what each tenant's requests taught it apart, so that one client's
        outputs never shape (nor time) another's; the others ignore it."""
        return settings

    @classmethod
    def forget_traffic(cls, settings: Any) -> Any:
        """The settings with what the drafters learnt from traffic back to what it was at load (a benchmark's next
        measurement); the drafters that learn nothing return them as they are."""
        return settings

    @classmethod
    def learnt_memory(cls, settings: Any) -> tuple[int, int]:
        """The bytes that what this engine's drafters learnt from traffic holds now (every tenant's), and the most it
        may hold: (0, 0) for the drafters that learn nothing."""
        return 0, 0

    def __init__(self, settings: Any, prompt: Sequence[int], sampling=None):
        """sampling: the request's SamplingParams (a drafter that samples drafts follows them)."""
        self.settings = settings

    def propose(self, step: StepResult) -> Proposal:
        """The next call's tree, after `step` (the last call, prefill included) accepted `step.tokens`."""
        raise NotImplementedError

    def finish(self, output_ids: Sequence[int], reason: str | None) -> None:
        """The request ended with `output_ids` (reason: its stop reason; "error" or "cancelled" when it failed or was
        cancelled). A drafter that learns from traffic (suffix decoding's pool) keeps what it gave."""


class GraphDrafter(Drafter):
    """The step graph drafts: its outputs hold the next call's tokens, and either the engine's static tree applies
    (the settings) or the graph outputs the tree too (dynamic trees). Plain decoding is the one-node case."""

    @classmethod
    def read_settings(cls, manifest: dict, source: str = "engine.yaml") -> Tree | None:
        """The static tree (None: dynamic, the graph outputs it)."""
        tree = manifest["tree"]
        if tree.get("dynamic"):
            return None
        return Tree.from_choices(tree["choices"], source=f"{source}: field tree.choices")

    def propose(self, step: StepResult) -> Proposal:
        out, tree = step.outputs, self.settings
        if not step.drafted:
            return Proposal.root(step.tokens[-1])
        if tree is not None:
            return Proposal(out[ef.NEXT_INPUT_IDS], tree.ancestor_mask[None], tree.depths, tree.paths[None])
        offsets = out[ef.NEXT_POSITION_OFFSETS][0]
        return Proposal(out[ef.NEXT_INPUT_IDS], out[ef.NEXT_TREE_MASK], offsets, out[ef.NEXT_PATHS])
