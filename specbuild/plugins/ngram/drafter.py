"""Prompt lookup drafting on the host (numpy only): the last n tokens (n = max_ngram_size down to 1) are looked up
among earlier n-grams of the prompt and the generated text; the tokens that followed the leftmost occurrences are
the drafts (../shared/reference/algorithms-and-formats.md §6). With `candidates` > 1, the continuations of several
occurrences are merged by shared prefix into one tree.

The n-gram index grows by the accepted tokens only, so a step costs O(accepted tokens + drafts), never O(context).
"""

from __future__ import annotations

import functools

from specbuild.runtime.drafter import Drafter, Proposal, SequenceState
from specbuild.tree import Tree

SCAN_PER_CANDIDATE = 8  # occurrences looked at per wanted continuation (the distinct ones are kept)


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
        self._starts: dict[tuple, list[int]] = {}  # n-gram -> start positions, in increasing order
        self._indexed = 0  # tokens whose n-grams (ending there) are in the index

    def observe(self, seq: SequenceState) -> None:
        tokens, starts = seq.tokens, self._starts
        for end in range(self._indexed, len(tokens)):
            for n in range(1, min(self.max_n, end + 1) + 1):
                starts.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end - n + 1)
        self._indexed = len(tokens)

    def continuations(self, tokens: list[int]) -> list[list[int]]:
        """The drafts: distinct continuations of the longest suffix n-gram that occurred before (leftmost first)."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), 0, -1):
            found: list[list[int]] = []
            for start in self._starts.get(tuple(tokens[length - n :]), ())[: SCAN_PER_CANDIDATE * self.candidates]:
                begin = start + n
                if begin >= length:  # the suffix itself
                    break
                continuation = tokens[begin : begin + self.num_draft]
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == self.candidates:
                        break
            if found:
                return found
        return []

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
