"""The responses an engine gave before, in one SuffixTrie that every request's drafter matches against: what
suffix decoding learns from traffic.

- Bounded in memory at every moment: at most `max_nodes` trie nodes, and as many response tokens (repeated responses
  add tokens but no nodes). Before a response joins, the oldest leave (SuffixDecoding's FIFO eviction, counted in
  nodes and tokens rather than responses so that the bound is bytes), as many as make room for every node its runs
  could add; `memory_bytes` / `bound_bytes` are what it holds and the most it can.
- A response joins when its request ends (not while it runs: the request's own tokens are in its own trie); `version`
  changes with every change, so a drafter knows when to match its context again.
- One pool per tenant (`PoolSet`): in `serve` with API keys each key's requests learn from that key's responses only
  (a shared pool would let one client's outputs shorten, and so time, another's requests: docs/modes.md).
- Kept across runs in a directory (`--draft-pool DIR`): one JSON-lines file per tenant, a response per line, appended
  as responses join and rewritten with the responses the bound keeps when the pool is read back.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
from array import array
from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.plugins.suffix.trie import NODE_BYTES, SuffixTrie, most_new_nodes, root_dict_bytes

SHARED = "shared"  # the file name part of the pool of requests without a tenant
ARRAY_SLACK = 1.125  # CPython's arrays allot up to about 1/16 more than they hold (1/8 said, to be safe)
ARRAY_HEADER_BYTES = 80  # an array object's own bytes (64 on CPython 3.11), per array


@functools.lru_cache(maxsize=8)
def _dict_bytes(entries: int) -> int:
    """The root dict of `entries` tokens, with its int objects (what root_dict_bytes says of one that full)."""
    return root_dict_bytes(dict.fromkeys(range(1 << 40, (1 << 40) + entries), 0))


class SuffixPool:
    """Earlier responses (token ids), oldest first, and their trie; `path`: where they are kept across runs.

    The responses are one flat int32 array (oldest first, from `_head`) and their lengths another (from `_first`):
    evicting the oldest moves the heads; the arrays are compacted once their dead half is the larger."""

    def __init__(self, depth: int, max_nodes: int, path: Path | None = None, vocab_size: int | None = None):
        self.trie = SuffixTrie(depth)
        self.max_nodes = max_nodes
        self.vocab_size = vocab_size
        self._tokens = array("i")  # the held responses' tokens, from _head
        self._lengths = array("i")  # their lengths, from _first
        self._head = self._first = 0
        self.tokens = 0  # in the responses held
        self.version = 0
        self.evicted = 0  # responses evicted (or, alone over the bound, never added) so far
        self.path = path
        self._lock = threading.Lock()
        if path is not None and path.exists():
            for tokens in _read(path, vocab_size):
                self._add(tokens)
            self._rewrite()

    @property
    def responses(self) -> list[array]:
        """The responses held, oldest first."""
        out, start = [], self._head
        for length in self._lengths[self._first :]:
            out.append(self._tokens[start : start + length])
            start += length
        return out

    def add(self, tokens) -> None:
        """A finished response joins; the oldest leave first, as many as keep the trie and the tokens held within
        the bound whatever nodes it adds (a response alone over the bound is not kept)."""
        tokens = [int(t) for t in tokens]
        if not tokens or self.max_nodes <= 0:
            return
        with self._lock:
            self._add(tokens)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(tokens) + "\n")

    def _add(self, tokens: list[int]) -> None:
        grows = most_new_nodes(len(tokens), self.trie.depth)
        if grows > self.max_nodes or len(tokens) > self.max_nodes:
            self.evicted += 1
            return
        while self._first < len(self._lengths) and (
            self.trie.nodes + grows > self.max_nodes or self.tokens + len(tokens) > self.max_nodes
        ):
            self._evict_oldest()
        self.trie.add(tokens)
        self._tokens.extend(array("i", tokens))
        self._lengths.append(len(tokens))
        self.tokens += len(tokens)
        self.version += 1

    def _evict_oldest(self) -> None:
        length = self._lengths[self._first]
        self.trie.remove(self._tokens[self._head : self._head + length])
        self._head += length
        self._first += 1
        self.tokens -= length
        self.evicted += 1
        if 2 * self._head > len(self._tokens):
            del self._tokens[: self._head]
            self._head = 0
        if 2 * self._first > len(self._lengths):
            del self._lengths[: self._first]
            self._first = 0

    def _rewrite(self) -> None:
        """The file holds the responses kept (written beside it, then moved over it: never half written)."""
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(json.dumps(r.tolist()) + "\n" for r in self.responses), encoding="utf-8")
        partial.replace(self.path)

    @property
    def nodes(self) -> int:
        return self.trie.nodes

    def memory_bytes(self) -> int:
        """What the pool holds in memory: its trie and its responses' arrays as allotted."""
        return self.trie.memory_bytes() + sys.getsizeof(self._tokens) + sys.getsizeof(self._lengths)

    def bound_bytes(self) -> int:
        """The most `memory_bytes` can be: node arrays of the power of two above the bound (they double), a root
        dict of the whole vocabulary (or of the bound, if smaller or the vocabulary unknown), token and length
        arrays twice the bound (compacted at half dead); CPython's arrays allot up to 1/8 more than they hold."""
        slots = 1 << self.max_nodes.bit_length()  # >= max_nodes + 1 (the root)
        entries = min(self.max_nodes, self.vocab_size or self.max_nodes)
        free = 4 * slots  # the free slots' int32 list
        arrays = NODE_BYTES * slots + free + 2 * 4 * (2 * self.max_nodes)
        return int(ARRAY_SLACK * arrays) + 10 * ARRAY_HEADER_BYTES + _dict_bytes(entries)  # 7 node arrays, 3 more


def _read(path: Path, vocab_size: int | None) -> list[list[int]]:
    """The responses of a pool file; a line cut short by a crash (the last, without its newline) is dropped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecbuildError(f"{path}: cannot read the draft pool: {exc}") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        lines.pop()  # no newline after it: cut short
    out = []
    for n, line in enumerate(lines, 1):
        try:
            tokens = json.loads(line)
        except json.JSONDecodeError:
            tokens = None
        ok = isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        if not ok or any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in tokens):
            limit = f" below {vocab_size}" if vocab_size is not None else ""
            raise SpecbuildError(f"{path}:{n}: not a draft pool line (a JSON list of token ids{limit})")
        out.append(tokens)
    return out


class PoolSet:
    """The pools of one engine: one per tenant, made when a tenant's first request comes (read from `directory`
    where one is kept)."""

    def __init__(self, depth: int, max_nodes: int, directory: Path | None = None, vocab_size: int | None = None):
        self.depth, self.max_nodes, self.directory, self.vocab_size = depth, max_nodes, directory, vocab_size
        self._pools: dict[str | None, SuffixPool] = {}
        self._lock = threading.Lock()
        if directory is not None:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SpecbuildError(f"--draft-pool {directory}: cannot make the directory: {exc}") from None

    def get(self, tenant: str | None) -> SuffixPool | None:
        if self.max_nodes <= 0:
            return None
        with self._lock:
            pool = self._pools.get(tenant)
            if pool is None:
                name = tenant if tenant is not None else SHARED
                if not name.replace("-", "").isalnum():
                    raise SpecbuildError(f"draft pool tenant {tenant!r}: letters, digits and '-' only")
                path = self.directory / f"suffix-{name}.jsonl" if self.directory is not None else None
                pool = self._pools[tenant] = SuffixPool(self.depth, self.max_nodes, path, self.vocab_size)
            return pool

    def memory(self) -> tuple[int, int]:
        """The bytes all the pools hold now, and the most they may (each pool's bound_bytes)."""
        with self._lock:
            pools = list(self._pools.values())
        return sum(p.memory_bytes() for p in pools), sum(p.bound_bytes() for p in pools)
