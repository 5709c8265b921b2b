"""What the generation loop asks of a mode: a drafter proposes the tree the next engine call verifies.

The loop is propose -> verify/accept (one engine call) -> commit, for every mode:
- `Drafter.propose(seq)` returns a `Proposal`: the tokens to verify (the root -- the last emitted token, not yet in
  the KV cache -- then the drafts) and their tree (ancestor mask, position offsets, root-to-leaf paths);
- `Drafter.observe(seq)` is told after every call (prefill included) that `seq.tokens` grew by the accepted tokens.

Modes whose step graph drafts the next tree (Medusa, EAGLE) use GraphDrafter, which reads the graph's outputs;
host-drafted modes (n-gram) compute proposals themselves. Drafters are numpy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specbuild import engine_format as ef
from specbuild.tree import Tree


@dataclasses.dataclass
class SequenceState:
    """One sequence being generated: its tokens (prompt, then every emitted token; the last one is the root of the
    next tree and not in the KV cache yet) and the outputs of its last engine call."""

    tokens: list[int]
    outputs: dict
    prompt_length: int


@dataclasses.dataclass
class Proposal:
    """What one engine call verifies: tokens [1,N] (root first), mask [1,N,N] (bool, node i sees node j),
    offsets [N] (depth = position offset from the root), paths [1,NP,DP] (node indices, -1 padded)."""

    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    paths: np.ndarray

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])

    def root_only(self) -> Proposal:
        """The root alone (near the end of the cache)."""
        return Proposal(
            self.tokens[:, :1],
            np.ones((1, 1, 1), dtype=np.bool_),
            np.zeros(1, dtype=np.int64),
            np.zeros((1, 1, 1), dtype=np.int64),
        )

    @classmethod
    def from_tree(cls, tokens, tree: Tree) -> Proposal:
        return cls(
            np.asarray(tokens, dtype=np.int64).reshape(1, -1), tree.ancestor_mask[None], tree.depths, tree.paths[None]
        )


class Drafter:
    """The interface; `manifest` is the engine's engine.yaml (the mode's settings are under `mode`)."""

    def __init__(self, manifest: dict, source: str = "engine.yaml"):
        self.manifest = manifest

    def propose(self, seq: SequenceState) -> Proposal:
        raise NotImplementedError

    def observe(self, seq: SequenceState) -> None:
        """`seq.tokens` grew by the tokens the last call accepted (after prefill: the prompt and the first token)."""


class GraphDrafter(Drafter):
    """The step graph drafts: its outputs hold the next call's tokens, and either the engine's static tree applies
    or the graph outputs the tree too (dynamic trees). Plain decoding is the one-node case."""

    def __init__(self, manifest: dict, source: str = "engine.yaml"):
        super().__init__(manifest, source)
        tree = manifest["tree"]
        self.static_tree = None
        if not tree.get("dynamic"):
            self.static_tree = Tree.from_choices(tree["choices"], source=f"{source}: field tree.choices")

    def propose(self, seq: SequenceState) -> Proposal:
        out = seq.outputs
        tokens = out[ef.NEXT_INPUT_IDS]
        if self.static_tree is not None:
            tree = self.static_tree
            return Proposal(tokens, tree.ancestor_mask[None], tree.depths, tree.paths[None])
        return Proposal(tokens, out[ef.NEXT_TREE_MASK], out[ef.NEXT_POSITION_OFFSETS][0], out[ef.NEXT_PATHS])
