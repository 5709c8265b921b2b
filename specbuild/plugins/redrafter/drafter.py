"""The ReDrafter mode's runtime drafter (numpy): the step graph drafts the next tree (merged beams, padded to a
fixed size); the proposal is its first `next_num_tokens` nodes, so duplicated beam prefixes are verified once."""

from __future__ import annotations

from specbuild.runtime.drafter import GraphDrafter, Proposal, SequenceState

NUM_TOKENS = "next_num_tokens"


class RedrafterDrafter(GraphDrafter):
    def propose(self, seq: SequenceState) -> Proposal:
        out = seq.outputs
        n = int(out[NUM_TOKENS][0])
        return Proposal(
            out["next_input_ids"][:, :n],
            out["next_tree_mask"][:, :n, :n],
            out["next_position_offsets"][0, :n],
            out["next_paths"],
        )
