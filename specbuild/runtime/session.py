"""A session: one sequence advanced one engine call at a time in a batch of its own (one KV slot).

The scheduler (runtime/scheduler.py) runs many sequences in one batch; a Session is the same machinery for one
sequence driven by hand -- `prefill(ids)` runs the prompt, `step()` asks the drafter for a tree after the last call
and verifies it, `verify(proposal)` runs one call on a given tree -- for tests, for the logits of a prompt, and for
whoever wants to drive the calls themselves.
"""

from __future__ import annotations

from specbuild.runtime.batch import Batch, Call, Sequence
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.layout import Layout
from specbuild.runtime.slots import initial_capacity


class Session:
    def __init__(self, layout: Layout, backend, sampling, expected_tokens: int, drafter: Drafter | None = None):
        """expected_tokens: prompt + one step's tokens; the cache starts at the next power of two and grows.
        drafter: proposes the trees `step()` verifies (None: prefill and verify only)."""
        self.layout = layout
        self.batch = Batch(layout, backend, 1, initial_capacity(layout, expected_tokens))
        self.sequence = Sequence(layout, sampling, drafter)
        self.batch.add(self.sequence)

    @property
    def length(self) -> int:
        """Tokens in the KV cache."""
        return self.batch.kv.lengths[0]

    @property
    def last(self) -> StepResult | None:
        return self.sequence.last

    @property
    def engine_s(self) -> float:
        return self.batch.engine_s

    def fits(self, size: int) -> bool:
        return self.length + size <= self.layout.max_seq_len

    def prefill(self, ids: list[int], window: int = 1) -> StepResult:
        """Run the prompt (its last `window` positions get logits); the first token is accepted from it. A prompt
        longer than LongRoPE's switch rotates with the long factors (a session's later calls keep the prompt's
        factors: the scheduler is what recomputes a sequence that grows past the switch)."""
        self.sequence.long_rope = self.layout.long_rope(len(ids))
        return self.batch.run([Call.prompt(ids, window)])[0]

    def step(self) -> StepResult | None:
        """Verify the drafter's tree after the last call (the root alone near the end of the cache); None when not
        even the root fits."""
        proposal = self.sequence.drafter.propose(self.last)
        if not self.fits(proposal.size):
            if not self.fits(1):
                return None
            proposal = proposal.root_only()
        return self.verify(proposal)

    def verify(self, proposal: Proposal) -> StepResult:
        """One engine call on the proposed tree, then commit the accepted nodes' KV and state."""
        return self.batch.run([Call.tree(proposal)])[0]
