"""Prompt lookup drafting on the host (numpy only): the continuation of the longest earlier match of the latest tokens
in the prompt and the generated text (runtime/context_index.py) is the draft.

How many drafts: `draft_length: match` (the default of new engines) drafts as many tokens as the match is long, up
to num_draft_tokens: one token after a one-token match, the whole budget in a long copy. Every draft token makes the
verification call dearer (on a CPU with int4 weights each costs ~20 % of a one-token step), and a short match is
rarely followed for long. `fixed` always drafts num_draft_tokens (what engines without the key do).
With `candidates` > 1, the continuations of several occurrences (longest matches first) are merged by shared
prefix into one tree.

A step costs O(accepted tokens + drafts), never O(context).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specbuild.plugins.ngram import DRAFT_LENGTHS
from specbuild.runtime.context_index import ContextIndex
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.manifest import check_fields, integer, one_of


@dataclasses.dataclass(frozen=True)
class NgramSettings:
    """engine.yaml `mode.drafter` (NgramDrafter.SCHEMA)."""

    max_n: int  # max_ngram_size
    num_draft: int  # num_draft_tokens
    candidates: int
    draft_length: str  # one of DRAFT_LENGTHS; engines written before the key existed draft a fixed number


class NgramDrafter(Drafter):
    # the engine.yaml fields it reads (checked like runtime/manifest.py's SCHEMA; engines written before
    # draft_length existed draft a fixed number)
    SCHEMA = {
        "mode": {
            "drafter": {
                "max_ngram_size": integer(1),
                "num_draft_tokens": integer(1),
                "candidates": integer(1),
                "draft_length": one_of(DRAFT_LENGTHS, optional=True),
            }
        }
    }

    @classmethod
    def read_settings(cls, manifest: dict, source: str = "engine.yaml") -> NgramSettings:
        check_fields(manifest, cls.SCHEMA, source)
        settings = manifest["mode"]["drafter"]
        sizes = (settings[key] for key in ("max_ngram_size", "num_draft_tokens", "candidates"))
        return NgramSettings(*sizes, settings.get("draft_length", "fixed"))

    def __init__(self, settings: NgramSettings, prompt: Sequence[int], sampling=None):
        super().__init__(settings, prompt, sampling)
        self.num_draft, self.candidates, self.draft_length = (
            settings.num_draft,
            settings.candidates,
            settings.draft_length,
        )
        self.index = ContextIndex(settings.max_n, prompt)

    def propose(self, step: StepResult) -> Proposal:
        self.index.observe(step.tokens)
        return self.draft()

    def continuations(self) -> list[list[int]]:
        """The drafts: distinct continuations of the best matches (see the module docstring)."""
        if self.draft_length == "fixed":
            return self.index.continuations(lambda matched: self.num_draft, self.candidates)
        return self.index.continuations(lambda matched: min(self.num_draft, matched), self.candidates)

    def draft(self) -> Proposal:
        """The tree of the continuations of the sequence so far, rooted at its last token."""
        return Proposal.from_continuations(self.index.tokens[-1], self.continuations())
