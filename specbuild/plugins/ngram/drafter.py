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

import functools

from specbuild.errors import SpecbuildError
from specbuild.plugins.ngram import DRAFT_LENGTHS
from specbuild.runtime.drafter import Drafter, Proposal, SequenceState
from specbuild.tree import Tree

SCAN_PER_CANDIDATE = 8  # most recent occurrences measured per wanted continuation
MAX_MATCH = 16  # context tokens compared when measuring an occurrence's match


@functools.lru_cache(maxsize=512)
def _tree(choices: tuple) -> Tree:
    return Tree.from_choices(list(choices))


class NgramDrafter(Drafter):
    def __init__(self, manifest: dict, source: str = "engine.yaml"):
        super().__init__(manifest, source)
        settings = manifest["mode"]["drafter"]
        self.max_n = int(settings["max_ngram_size"])
        self.num_draft = int(settings["num_draft_tokens"])
        self.candidates = int(settings["candidates"])
        self.draft_length = settings.get("draft_length", "fixed")
        if self.draft_length not in DRAFT_LENGTHS:
            raise SpecbuildError(
                f"{source}: field mode.drafter.draft_length must be one of {', '.join(DRAFT_LENGTHS)}, "
                f"got {self.draft_length!r}"
            )
        self._starts: dict[tuple, list[int]] = {}  # n-gram -> start positions, in increasing order
        self._indexed = 0  # tokens whose n-grams (ending there) are in the index

    def observe(self, seq: SequenceState) -> None:
        tokens, starts = seq.tokens, self._starts
        for end in range(self._indexed, len(tokens)):
            for n in range(1, min(self.max_n, end + 1) + 1):
                starts.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end - n + 1)
        self._indexed = len(tokens)

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

    def propose(self, seq: SequenceState) -> Proposal:
        root = seq.tokens[-1]
        found = self.continuations(seq.tokens)
        if len(found) <= 1:
            drafts = found[0] if found else []
            return Proposal.from_tree([root, *drafts], _tree(tuple((0,) * d for d in range(1, len(drafts) + 1))))
        children: dict[tuple, dict[int, int]] = {}  # trie: path of ranks -> {token: rank of the child}
        token_of: dict[tuple, int] = {(): root}
        for continuation in found:
            path: tuple = ()
            for token in continuation:
                ranks = children.setdefault(path, {})
                path = (*path, ranks.setdefault(token, len(ranks)))
                token_of[path] = token
        tree = _tree(tuple(sorted(p for p in token_of if p)))
        tokens = [0] * tree.size
        for path, token in token_of.items():
            tokens[tree.node_index(path)] = token
        return Proposal.from_tree(tokens, tree)
