"""The context's n-gram index, for drafters that copy (numpy-free, host only): where the latest tokens occurred
before in the prompt and the generated text, and what followed them (prompt lookup,
github.com/apoorvumang/prompt-lookup-decoding).

Which occurrence, and how many tokens of what followed:
- the most recent occurrences of the longest suffix n-gram (n = max_n down to 1) that occurred before are measured:
  how many tokens before them agree with the end of the context (the match, up to MAX_MATCH); the longest match
  wins, the most recent among equals (the original algorithm takes the leftmost occurrence; the longest recent one
  is accepted more often);
- a continuation is as long as the caller's `length(match)` says, distinct ones in order of their matches.

The index grows by the accepted tokens only, so a lookup costs O(accepted tokens + drafts), never O(context).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

SCAN_PER_CANDIDATE = 8  # most recent occurrences measured per wanted continuation
MAX_MATCH = 16  # context tokens compared when measuring an occurrence's match


class ContextIndex:
    """Start positions of every n-gram (n <= max_n) of a growing token sequence."""

    def __init__(self, max_n: int, tokens: Sequence[int] = ()):
        self.max_n = max_n
        self.tokens: list[int] = []  # the sequence so far: the prompt, then every accepted token
        self._starts: dict[tuple, list[int]] = {}  # n-gram -> start positions, in increasing order
        self.observe(tokens)

    def observe(self, accepted: Sequence[int]) -> None:
        """The sequence grew by `accepted`: index the n-grams ending at the new tokens (O(new tokens))."""
        tokens, starts, begin = self.tokens, self._starts, len(self.tokens)
        tokens.extend(int(t) for t in accepted)
        for end in range(begin, len(tokens)):
            for n in range(1, min(self.max_n, end + 1) + 1):
                starts.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end - n + 1)

    def matches(self, candidates: int = 1) -> list[tuple[int, int]]:
        """(match length, where the continuation begins) for the most recent earlier occurrences of the longest
        suffix n-gram that occurred before, longest match first (most recent first among equals)."""
        tokens, length = self.tokens, len(self.tokens)
        scan = SCAN_PER_CANDIDATE * candidates
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

    def continuations(self, length: Callable[[int], int], candidates: int = 1) -> list[list[int]]:
        """At most `candidates` distinct continuations of the best matches, each `length(match length)` tokens long
        (or up to the end of the context)."""
        found: list[list[int]] = []
        for matched, begin in self.matches(candidates):
            continuation = self.tokens[begin : begin + length(matched)]
            if continuation and continuation not in found:
                found.append(continuation)
                if len(found) == candidates:
                    break
        return found
