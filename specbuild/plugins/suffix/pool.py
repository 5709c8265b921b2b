"""The responses an engine gave before, in one SuffixTrie that every request's drafter matches against: what
suffix decoding learns from traffic.

- Bounded in memory: at most `max_nodes` trie nodes, and as many response tokens (repeated responses add tokens but no
  nodes); past either the oldest responses leave first (SuffixDecoding's FIFO eviction, counted in nodes and tokens
  rather than responses so that the bound is bytes).
- A response joins when its request ends (not while it runs: the request's own tokens are in its own trie); `version`
  changes with every change, so a drafter knows when to match its context again.
- One pool per tenant (`PoolSet`): in `serve` with API keys each key's requests learn from that key's responses only
  (a shared pool would let one client's outputs shorten, and so time, another's requests: docs/modes.md).
- Kept across runs in a directory (`--draft-pool DIR`): one JSON-lines file per tenant, a response per line, appended
  as responses join and rewritten with the responses the bound keeps when the pool is read back.
"""

from __future__ import annotations

import collections
import json
import threading
from array import array
from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.plugins.suffix.trie import SuffixTrie

SHARED = "shared"  # the file name part of the pool of requests without a tenant


class SuffixPool:
    """Earlier responses (token ids), oldest first, and their trie; `path`: where they are kept across runs."""

    def __init__(self, depth: int, max_nodes: int, path: Path | None = None, vocab_size: int | None = None):
        self.trie = SuffixTrie(depth)
        self.max_nodes = max_nodes
        self.responses: collections.deque[array] = collections.deque()  # int32 token ids
        self.tokens = 0  # in the responses held
        self.version = 0
        self.evicted = 0  # responses evicted so far
        self.path = path
        self._lock = threading.Lock()
        if path is not None and path.exists():
            for tokens in _read(path, vocab_size):
                self._add(tokens)
            self._rewrite()

    def add(self, tokens) -> None:
        """A finished response joins; the oldest leave while the trie is over its bound (this one too, alone)."""
        tokens = [int(t) for t in tokens]
        if not tokens or self.max_nodes <= 0:
            return
        with self._lock:
            self._add(tokens)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(tokens) + "\n")

    def _add(self, tokens: list[int]) -> None:
        self.trie.add(tokens)
        self.responses.append(array("i", tokens))
        self.tokens += len(tokens)
        while (self.trie.nodes > self.max_nodes or self.tokens > self.max_nodes) and self.responses:
            oldest = self.responses.popleft()
            self.trie.remove(oldest)
            self.tokens -= len(oldest)
            self.evicted += 1
        self.version += 1

    def _rewrite(self) -> None:
        """The file holds the responses kept (written beside it, then moved over it: never half written)."""
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(json.dumps(r.tolist()) + "\n" for r in self.responses), encoding="utf-8")
        partial.replace(self.path)

    @property
    def nodes(self) -> int:
        return self.trie.nodes


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
