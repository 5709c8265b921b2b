"""Prompt lookup drafting on the host (numpy only): the last n tokens (n = max_ngram_size down to 1) are looked up
among earlier n-grams of the prompt and the generated text, and the tokens that followed an earlier occurrence are
the drafts (../shared/reference/algorithms-and-formats.md §6).

Which occurrence, and how many drafts:
- the most recent occurrences of the longest suffix n-gram are measured: how many tokens before them agree with
  the end of the context (the match, up to MAX_MATCH); the longest match wins, the most recent among equals (the
  original algorithm takes the leftmost occurrence; the longest recent one is accepted more often);
- `draft_length: match` (the default of new engines) drafts as many tokens as the match is long, up to
  num_draft_tokens: one token after a one-token match, the whole budget in a long copy. Every draft token makes the
  verification call dearer (on a CPU with int4 weights each costs ~20 % of a one-token step), and a short match is
  rarely followed for long. `fixed` always drafts num_draft_tokens (what engines without the key do).
With `candidates` > 1, the continuations of several occurrences (longest matches first) are merged by shared
prefix into one tree.

The n-gram index grows by the accepted tokens only, so a step costs O(accepted tokens + drafts), never O(context).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specbuild.plugins.ngram import DRAFT_LENGTHS
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.manifest import check_fields, integer, one_of

SCAN_PER_CANDIDATE = 8  # most recent occurrences measured per wanted continuation
MAX_MATCH = 16  # context tokens compared when measuring an occurrence's match


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
        self.max_n, self.num_draft = settings.max_n, settings.num_draft
        self.candidates, self.draft_length = settings.candidates, settings.draft_length
        self.tokens: list[int] = []  # the sequence so far: the prompt, then every accepted token
        self._starts: dict[tuple, list[int]] = {}  # n-gram -> start positions, in increasing order
        self.observe(prompt)

    def observe(self, accepted: Sequence[int]) -> None:
        """The sequence grew by `accepted`: index the n-grams ending at the new tokens (O(new tokens))."""
        tokens, starts, begin = self.tokens, self._starts, len(self.tokens)
        tokens.extend(accepted)
        for end in range(begin, len(tokens)):
            for n in range(1, min(self.max_n, end + 1) + 1):
                starts.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end - n + 1)

    def propose(self, step: StepResult) -> Proposal:
        self.observe(step.tokens)
        return self.draft()

    def matches(self, tokens: list[int]) -> list[tuple[int, int]]:
        """(match length, where the continuation begins) for the most recent earlier occurrences of the longest
        suffix n-gram that occurred before, longest match first (most recent first among equals)."""
        length = len(tokens)
        scan = SCAN_PER_CANDIDATE * self.candidates
        for n in range(min(self.max_n, length - 1), 0, -1):
            starts = self._starts.get(tuple(tokens[length - n :]))
            if not starts:
                continue
            found = []
            for start in reversed(starts[-(scan + 1) :]):  # one more: the suffix itself is the last start
                begin = start + n
                if begin >= length:
                    continue
                matched = n
                while (
                    matched < MAX_MATCH
                    and begin - matched > 0
                    and tokens[begin - matched - 1] == tokens[length - matched - 1]
                ):
                    matched += 1
                found.append((matched, begin))
            if found:
                found.sort(key=lambda m: -m[0])  # stable: the most recent first among equal matches
                return found
        return []

    def continuations(self, tokens: list[int]) -> list[list[int]]:
        """The drafts: distinct continuations of the best matches (see the module docstring)."""
        found: list[list[int]] = []
        for matched, begin in self.matches(tokens):
            count = self.num_draft if self.draft_length == "fixed" else min(self.num_draft, matched)
            continuation = tokens[begin : begin + count]
            if continuation not in found:
                found.append(continuation)
                if len(found) == self.candidates:
                    break
        return found

    def draft(self) -> Proposal:
        """The tree of the continuations of the sequence so far, rooted at its last token."""
        return Proposal.from_continuations(self.tokens[-1], self.continuations(self.tokens))
