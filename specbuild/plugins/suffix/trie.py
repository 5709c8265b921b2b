"""Counts of every run of at most `depth` tokens in a set of token sequences, and the drafts they suggest.

A `SuffixTrie` holds, for each sequence added to it, every suffix of every prefix cut at `depth` tokens: node n is one
run of tokens (the path from the root), `count[n]` how many times it occurs in the sequences. It is SuffixDecoding's
suffix tree (arXiv 2411.04975) without path compression, in flat integer arrays (26 bytes a node, no Python object
per node): the root's children in a dict (a vocabulary wide), every other node's in a sibling list (a few each).

- `extend(cursor, token)` appends a token to a sequence being added: the `depth` suffixes that end at it gain one
  count each (O(depth));
- `remove(tokens)` takes a whole sequence out again (O(len x depth)): nodes whose count falls to 0 are freed and
  reused, so the trie's size follows what it holds;
- `matches(cursor)` / `advance(matched, token)`: the nodes of the context's suffixes that occur in the trie,
  shortest first (a suffix occurs only if the shorter ones do: one list per context, O(depth) per new token);
- `draft(node, budget, min_prob)`: the continuations of a matched run, most probable first, as a tree grown
  best-first: a node's probability is the product along its path of count(child) / sum of its siblings' counts
  (what followed the run, among its occurrences that were followed by anything), cut at `min_prob`.
"""

from __future__ import annotations

import heapq
import sys
from array import array

ROOT = 0
NONE = -1


INT_OBJECT_BYTES = 32  # a Python int below 2**62 (the root dict's keys and values)
NODE_BYTES = 26  # a node's slot in the node arrays: six int32 and one uint16 (SuffixTrie.__init__)


def root_dict_bytes(root: dict) -> int:
    """The root's dict (token -> node) and its keys' and values' int objects."""
    return sys.getsizeof(root) + 2 * INT_OBJECT_BYTES * len(root)


def most_new_nodes(length: int, depth: int) -> int:
    """The most nodes a sequence of `length` tokens can add: its runs of at most `depth` tokens, all new."""
    full = max(0, length - depth + 1)  # starts followed by a whole depth of tokens
    return full * depth + sum(min(depth, length - start) for start in range(full, length))


class SuffixTrie:
    """Every run of at most `depth` tokens of the sequences added, with its count (see the module docstring)."""

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"suffix trie depth must be >= 1, got {depth}")
        self.depth = depth
        self._token = array("i", [NONE])
        self._count = array("i", [0])
        self._followed = array("i", [0])  # the sum of the children's counts
        self._parent = array("i", [NONE])
        self._level = array("H", [0])  # the node's run length
        self._first = array("i", [NONE])  # the first child (not the root's: see _root)
        self._next = array("i", [NONE])  # the next sibling
        self._root: dict[int, int] = {}  # token -> the root's child
        self._free = array("i")  # freed node slots, reused first
        self._size = 1  # slots in use or freed (the arrays are allocated ahead, doubling)

    @property
    def nodes(self) -> int:
        """Nodes in use (the root not counted): what the memory bound of a pool counts."""
        return self._size - 1 - len(self._free)

    def memory_bytes(self) -> int:
        """What the trie holds in memory: its arrays as allotted, the root's dict and its int objects."""
        arrays = (self._token, self._count, self._followed, self._parent, self._level, self._first, self._next)
        return sum(map(sys.getsizeof, arrays)) + sys.getsizeof(self._free) + root_dict_bytes(self._root)

    def count(self, node: int) -> int:
        return self._count[node]

    def followed(self, node: int) -> int:
        """How many of the run's occurrences something followed (the sum of its children's counts)."""
        return self._followed[node]

    def child(self, node: int, token: int) -> int:
        """The child of `node` reached by `token` (NONE: the run does not occur)."""
        if node == ROOT:
            return self._root.get(token, NONE)
        c = self._first[node]
        tokens, siblings = self._token, self._next
        while c != NONE and tokens[c] != token:
            c = siblings[c]
        return c

    def children(self, node: int) -> list[int]:
        if node == ROOT:
            return list(self._root.values())
        out, c = [], self._first[node]
        while c != NONE:
            out.append(c)
            c = self._next[c]
        return out

    def token(self, node: int) -> int:
        return self._token[node]

    # ------------------------------------------------------------------ adding and removing sequences
    def extend(self, cursor: list[int], token: int) -> list[int]:
        """Append `token` to the sequence whose suffixes end at `cursor` (their nodes, shortest first; [] for a new
        sequence): every suffix that ends at the new token gains one count. Returns the new cursor. (The mode's hot
        loop, written out: no call per suffix but to allocate; the arrays grow in place, so the names stay bound.)"""
        token = int(token)
        tokens, count, followed, level, first, siblings = (
            self._token,
            self._count,
            self._followed,
            self._level,
            self._first,
            self._next,
        )
        node = self._root.get(token, NONE)
        if node == NONE:
            node = self._new(ROOT, token)
        count[node] += 1
        out = [node]
        depth = self.depth
        for parent in cursor:
            if level[parent] >= depth:
                break  # the cursor's runs grow by one token each: this one, the longest, is at the depth
            c = first[parent]
            while c != NONE and tokens[c] != token:
                c = siblings[c]
            if c == NONE:
                c = self._new(parent, token)
            count[c] += 1
            followed[parent] += 1
            out.append(c)
        return out

    def add(self, tokens) -> None:
        """Add a whole sequence."""
        cursor: list[int] = []
        for token in tokens:
            cursor = self.extend(cursor, token)

    def remove(self, tokens) -> None:
        """Take out a sequence added before (every run of it loses one count; runs left with none are freed)."""
        tokens = [int(t) for t in tokens]
        for start in range(len(tokens)):
            node, path = ROOT, []
            for token in tokens[start : start + self.depth]:
                node = self.child(node, token)
                if node == NONE:
                    raise ValueError("SuffixTrie.remove: the sequence was not added")
                path.append(node)
            for node in path:
                self._count[node] -= 1
                parent = self._parent[node]
                if parent != ROOT:
                    self._followed[parent] -= 1
            for i, node in enumerate(path):
                if self._count[node] == 0:  # it and the rest of the path occurred only here (counts fall with depth)
                    self._unlink(node)
                    self._free.extend(path[i:])
                    break

    def _new(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
        else:
            node = self._size
            self._size += 1
            if node == len(self._token):
                self._grow_arrays()
        self._token[node], self._count[node], self._followed[node] = token, 0, 0
        self._parent[node], self._level[node], self._first[node] = parent, self._level[parent] + 1, NONE
        if parent == ROOT:
            self._root[token] = node
            self._next[node] = NONE
        else:
            self._next[node] = self._first[parent]
            self._first[parent] = node
        return node

    def _grow_arrays(self) -> None:
        """Twice the node slots (arrays grow in place: what a pool's bound limits is what they hold)."""
        more = len(self._token)
        for a in (self._token, self._count, self._followed, self._parent, self._level, self._first, self._next):
            a.extend(array(a.typecode, [0]) * more)

    def _unlink(self, node: int) -> None:
        parent = self._parent[node]
        if parent == ROOT:
            del self._root[self._token[node]]
            return
        c = self._first[parent]
        if c == node:
            self._first[parent] = self._next[node]
            return
        while self._next[c] != node:
            c = self._next[c]
        self._next[c] = self._next[node]

    # ------------------------------------------------------------------ matching and drafting
    def matches(self, context, longest: int | None = None) -> list[int]:
        """The nodes of the context's last 1, 2, ... tokens that occur in the trie (shortest first; at most
        `longest`, default depth): O(depth^2), for a context met for the first time (then `advance`)."""
        longest = min(self.depth, len(context) if longest is None else longest)
        out = []
        for p in range(1, longest + 1):
            node = ROOT
            for token in context[len(context) - p :]:
                node = self.child(node, int(token))
                if node == NONE:
                    return out
            out.append(node)
        return out

    def advance(self, matched: list[int], token: int) -> list[int]:
        """`matches` after the context grew by `token`, from its matches before (O(depth))."""
        token = int(token)
        first = self.child(ROOT, token)
        if first == NONE:
            return []
        out = [first]
        for node in matched:
            if self._level[node] >= self.depth:
                break
            c = self.child(node, token)
            if c == NONE:
                break  # the longer suffixes do not occur either
            out.append(c)
        return out

    def draft(
        self, node: int, budget: int, min_prob: float, chain: bool = False
    ) -> tuple[list[tuple[int, int]], float]:
        """The most probable continuations of the run `node`: up to `budget` nodes grown best-first, each at least
        `min_prob` probable (chain: the most probable child of each node only). Returns ([(token, index of its
        parent in the list, -1: the run itself)], the sum of their probabilities: the tokens a verification would
        accept, expected)."""
        out: list[tuple[int, int]] = []
        score = 0.0
        heap: list[tuple[float, int, int, int]] = []  # (-probability, tie-break, trie node, parent index in out)
        serial = 0

        def push(parent_node: int, parent_index: int, prob: float) -> None:
            nonlocal serial
            total = self._followed[parent_node] if parent_node != ROOT else 0
            if total <= 0:
                return
            children = self.children(parent_node)
            if chain:
                children = [max(children, key=lambda c: (self._count[c], -c))]
            for c in children:
                p = prob * self._count[c] / total
                if p >= min_prob:
                    serial += 1
                    heapq.heappush(heap, (-p, serial, c, parent_index))

        push(node, -1, 1.0)
        while heap and len(out) < budget:
            neg, _, c, parent_index = heapq.heappop(heap)
            out.append((self._token[c], parent_index))
            score -= neg
            if self._level[c] < self.depth:
                push(c, len(out) - 1, -neg)
        return out, score
