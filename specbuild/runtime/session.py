"""A session: one sequence's state -- KV cache, length, mode states, drafter, random stream, sampling -- advanced
one engine call at a time on an engine's backend.

`prefill(ids)` runs the prompt; `step()` asks the drafter for a tree after the last call and verifies it;
`verify(proposal)` runs one call on a given tree. Each call is decoded once, here, into a `StepResult` (accepted
tokens, accepted nodes, raw outputs), and what the graph accepted is committed: the accepted nodes' KV rows and
mode state (O(accepted tokens) host work; the cache is bound to the backend without a copy). Engines are built for
one sequence (`limits.max_batch_size` 1); the session keeps every per-sequence quantity on itself and reads only
the engine's immutable Layout, so that a batch is a list of sessions' rows later, not a rewrite.
"""

from __future__ import annotations

import numpy as np

from specbuild import engine_format as ef
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.kv_cache import MIN_CAPACITY, GrowingCache, new_kv_cache
from specbuild.runtime.layout import Layout


class Session:
    def __init__(self, layout: Layout, backend, sampling, expected_tokens: int, drafter: Drafter | None = None):
        """expected_tokens: prompt + one step's tokens; the cache starts at the next power of two and grows.
        drafter: proposes the trees `step()` verifies (None: prefill and verify only)."""
        self.layout = layout
        self.backend = backend
        self.sampling = sampling
        self.drafter = drafter
        self.rng = np.random.default_rng(sampling.seed)
        needed = expected_tokens + layout.scratch_rows  # scratch rows the graph writes after each call's tokens
        capacity = min(layout.max_capacity, max(MIN_CAPACITY, 1 << (needed - 1).bit_length()))
        self.kv = new_kv_cache(layout, capacity, backend.bind)
        self.states = self._new_states(capacity)
        self._constant_feeds = {  # the same every call
            ef.TEMPERATURE: np.array([sampling.temperature], dtype=np.float32),
            ef.TOP_K: np.array([sampling.top_k], dtype=np.int64),
            ef.TOP_P: np.array([sampling.top_p], dtype=np.float32),
            ef.MIN_ROWS: np.zeros(layout.min_rows, dtype=np.bool_),  # read by step-padded graphs only
        }
        self.last: StepResult | None = None  # the last call's result
        self.engine_s = 0.0  # time inside the engine, all calls

    @property
    def length(self) -> int:
        """Tokens in the KV cache."""
        return self.kv.length

    def fits(self, size: int) -> bool:
        return self.kv.length + size <= self.layout.max_seq_len

    def prefill(self, ids: list[int], window: int = 1) -> StepResult:
        """Run the prompt (its last `window` positions get logits); the first token is accepted from it."""
        t = len(ids)
        out = self._run(
            np.array([ids], dtype=np.int64),
            np.arange(t, dtype=np.int64)[None],
            np.tril(np.ones((t, t), dtype=np.bool_))[None],
            np.array([[[t - 1]]], dtype=np.int64),
            window,
        )
        return self._accept(out, t, every_node=True)

    def step(self) -> StepResult | None:
        """Verify the drafter's tree after the last call (the root alone near the end of the cache); None when not
        even the root fits."""
        proposal = self.drafter.propose(self.last)
        if not self.fits(proposal.size):
            if not self.fits(1):
                return None
            proposal = proposal.root_only()
        return self.verify(proposal)

    def verify(self, proposal: Proposal) -> StepResult:
        """One engine call on the proposed tree, then commit the accepted nodes' KV and state."""
        size = proposal.size
        self.kv.ensure(self.kv.length + size + self.layout.scratch_rows)
        for cache in self.states.values():
            if isinstance(cache, GrowingCache):
                cache.ensure(cache.length + size)
        positions = np.add(proposal.offsets, self.kv.length, dtype=np.int64)[None]
        out = self._run(proposal.tokens, positions, proposal.mask, proposal.paths, size)
        return self._accept(out, size, every_node=False)

    # ------------------------------------------------------------------ internals
    def _run(self, input_ids, position_ids, tree_mask, paths, window: int) -> dict:
        rng = self.rng
        feeds = {
            ef.INPUT_IDS: input_ids,
            ef.POSITION_IDS: position_ids,
            ef.TREE_MASK: tree_mask,
            ef.PAST_LENGTH: np.array([self.kv.length], dtype=np.int64),
            ef.PATHS: paths,
            **self._constant_feeds,
            ef.RAND_ACCEPT: rng.random((1, window), dtype=np.float32),
            ef.RAND_SAMPLE: rng.random(1, dtype=np.float32),
        }
        for name, cache in self.states.items():
            feeds[ef.STATE_PREFIX + name] = cache.data if isinstance(cache, GrowingCache) else cache
        out = self.backend.run(feeds, self.kv.aliases, self.kv.feeds())
        self.engine_s += self.backend.last_engine_s
        return out

    def _accept(self, out: dict, size: int, every_node: bool) -> StepResult:
        """Decode the call (the one place that reads how many were accepted) and commit what it accepted."""
        count = int(out[ef.NUM_ACCEPTED][0])
        nodes = None if every_node else out[ef.ACCEPTED_NODES][0, :count]
        self.kv.commit(out, nodes, size)
        self._update_states(out, nodes)
        self.last = StepResult(out[ef.ACCEPTED_TOKENS][0, :count].tolist(), nodes, out)
        return self.last

    def _new_states(self, capacity: int) -> dict:
        states = {}
        for spec in self.layout.states:
            if spec.grow_axis is not None:
                states[spec.name] = GrowingCache(
                    spec.shape, spec.grow_axis, spec.dtype, self.layout.max_seq_len, capacity
                )
            else:
                states[spec.name] = np.full(spec.shape, spec.fill, dtype=spec.dtype)
        return states

    def _update_states(self, out: dict, nodes: np.ndarray | None) -> None:
        for name, cache in self.states.items():
            if isinstance(cache, GrowingCache):
                cache.commit(out[ef.NEW_STATE_PREFIX + name], nodes)
            else:
                self.states[name] = out[ef.NEXT_STATE_PREFIX + name]
