"""The ReDrafter mode's runtime drafter (numpy): the step graph drafts the next tree (merged beams, padded to a
fixed size); the proposal is its first `next_num_tokens` nodes, so duplicated beam prefixes are verified once."""

from __future__ import annotations

from specbuild import engine_format as ef
from specbuild.runtime.drafter import GraphDrafter, Proposal, StepResult


class RedrafterDrafter(GraphDrafter):
    def propose(self, step: StepResult) -> Proposal:
        out = step.outputs
        if not step.drafted:
            return Proposal.root(step.tokens[-1])
        n = int(out[ef.NEXT_NUM_TOKENS][0])
        return Proposal(
            out[ef.NEXT_INPUT_IDS][:, :n],
            out[ef.NEXT_TREE_MASK][:, :n, :n],
            out[ef.NEXT_POSITION_OFFSETS][0, :n],
            out[ef.NEXT_PATHS],
        )
