"""Suffix decoding's drafter (host only, no numpy in the hot path): after each step, the runs of tokens that end the
context are matched in two tries (plugins/suffix/trie.py) -- the request's own (its prompt and output) and the
engine's pool of earlier responses (plugins/suffix/pool.py) -- and the best-scoring continuation tree is the draft.

For every match length p (longest first) in either trie, up to min(num_draft_tokens, spec_factor x p) drafts are
grown best-first from the matched run, each at least min_prob probable; a draft's score is the sum of its tokens'
probabilities (the tokens a verification would accept, expected) and the best score wins, the longer match among
equals (SuffixDecoding's rule, arXiv 2411.04975). A score cannot exceed the drafts' number, so shorter matches are
not tried once their cap is below the best score, nor runs nothing followed.

A step costs O((accepted tokens + drafts) x depth): the matches are carried from step to step (trie.advance), and
found again from the last `depth` tokens only when the pool changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specbuild.plugins.suffix import SHAPES
from specbuild.plugins.suffix.pool import PoolSet, SuffixPool
from specbuild.plugins.suffix.trie import SuffixTrie
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.manifest import check_fields, integer, number, one_of


@dataclasses.dataclass(frozen=True)
class SuffixSettings:
    """engine.yaml `mode.drafter` (SuffixDrafter.SCHEMA), and the engine's pool of earlier responses."""

    num_draft: int
    depth: int
    min_prob: float
    spec_factor: float
    chain: bool
    pool_nodes: int
    pools: PoolSet | None = dataclasses.field(default=None, compare=False)  # the engine's pools, one per tenant
    pool: SuffixPool | None = dataclasses.field(default=None, compare=False)  # the pool of this request's tenant


class SuffixDrafter(Drafter):
    SCHEMA = {
        "mode": {
            "drafter": {
                "num_draft_tokens": integer(1),
                "depth": integer(2),
                "min_prob": number(),
                "spec_factor": number(),
                "shape": one_of(SHAPES),
                "pool_nodes": integer(0),
            }
        }
    }

    @classmethod
    def load_settings(cls, engine) -> SuffixSettings:
        """engine.yaml's settings, and the engine's pools (kept in `engine.draft_pool` where it names a directory)."""
        settings = super().load_settings(engine)
        vocab = engine.manifest["model"]["vocab_size"]
        pools = PoolSet(settings.depth, settings.pool_nodes, engine.draft_pool, vocab)
        return dataclasses.replace(settings, pools=pools, pool=pools.get(None))

    @classmethod
    def read_settings(cls, manifest: dict, source: str = "engine.yaml") -> SuffixSettings:
        check_fields(manifest, cls.SCHEMA, source)
        s = manifest["mode"]["drafter"]
        pools = PoolSet(s["depth"], s["pool_nodes"])
        return SuffixSettings(
            s["num_draft_tokens"],
            s["depth"],
            float(s["min_prob"]),
            float(s["spec_factor"]),
            s["shape"] == "chain",
            s["pool_nodes"],
            pools,
            pools.get(None),
        )

    @classmethod
    def for_tenant(cls, settings: SuffixSettings, tenant: str | None) -> SuffixSettings:
        """The tenant's own pool (see plugins/suffix/pool.py)."""
        if settings.pools is None or tenant is None:
            return settings
        return dataclasses.replace(settings, pool=settings.pools.get(tenant))

    @classmethod
    def forget_traffic(cls, settings: SuffixSettings) -> SuffixSettings:
        """New pools (read again from their files where the engine keeps them, as at load)."""
        if settings.pools is None:
            return settings
        old = settings.pools
        pools = PoolSet(old.depth, old.max_nodes, old.directory, old.vocab_size)
        return dataclasses.replace(settings, pools=pools, pool=pools.get(None))

    @classmethod
    def learnt_memory(cls, settings: SuffixSettings) -> tuple[int, int]:
        """The pools' bytes and their bound (plugins/suffix/pool.py)."""
        return settings.pools.memory() if settings.pools is not None else (0, 0)

    def __init__(self, settings: SuffixSettings, prompt: Sequence[int], sampling=None):
        super().__init__(settings, prompt, sampling)
        self.own = SuffixTrie(settings.depth)
        self.context: list[int] = []
        self.cursor: list[int] = []  # the own trie's nodes of the context's suffixes (shortest first)
        self.pool = settings.pool
        self.matched: list[int] = []  # the pool's nodes of the context's suffixes that occur there
        self.pool_version = -1
        self._observe(prompt)

    def _observe(self, tokens) -> None:
        pool = self.pool
        in_step = pool is not None and pool.version == self.pool_version
        for token in tokens:
            token = int(token)
            self.context.append(token)
            self.cursor = self.own.extend(self.cursor, token)
            if in_step:
                self.matched = pool.trie.advance(self.matched, token)
        if pool is not None and not in_step:
            self.matched = pool.trie.matches(self.context)
            self.pool_version = pool.version

    def propose(self, step: StepResult) -> Proposal:
        self._observe(step.tokens)
        return self.draft()

    def draft(self) -> Proposal:
        """The best-scoring continuation tree of the context, rooted at its last token (see the module)."""
        s = self.settings
        best, best_score = [], 0.0
        tries = [(self.own, self.cursor)]
        if self.pool is not None:
            tries.append((self.pool.trie, self.matched))
        for trie, nodes in tries:
            for p in range(len(nodes), 0, -1):
                if int(s.spec_factor * p) <= best_score:
                    break  # no shorter match can score more than its cap
                # a run of p tokens is followed by at most depth - p more in the trie
                cap = min(s.num_draft, int(s.spec_factor * p), s.depth - p)
                node = nodes[p - 1]
                if cap <= best_score or not trie.followed(node):
                    continue
                draft, score = trie.draft(node, cap, s.min_prob, s.chain)
                if draft and score > best_score:
                    best, best_score = draft, score
        return Proposal.from_continuations(self.context[-1], _paths(best))

    def finish(self, output_ids: Sequence[int], reason: str | None) -> None:
        """The request ended: a response it completed joins the pool."""
        if self.pool is not None and reason not in (None, "error", "cancelled"):
            self.pool.add(output_ids)
        self.own = None  # the request's own trie is freed with it


def _paths(draft: list[tuple[int, int]]) -> list[list[int]]:
    """The root-to-leaf token paths of a draft [(token, parent index)] (parents before children)."""
    if not draft:
        return []
    leaf = [True] * len(draft)
    for _, parent in draft:
        if parent >= 0:
            leaf[parent] = False
    paths = []
    for i, is_leaf in enumerate(leaf):
        if is_leaf:
            path, j = [], i
            while j >= 0:
                path.append(draft[j][0])
                j = draft[j][1]
            paths.append(path[::-1])
    return paths
