"""A session: one step graph, and one sequence's KV cache and mode state, advanced one engine call at a time.

`prefill(ids)` runs the prompt; each `verify(proposal)` runs one call on a proposed tree and commits what the graph
accepted: the accepted nodes' KV rows and mode state (O(accepted tokens) host work; the cache is bound to the
engine without a copy). Engines are built for one sequence (`limits.max_batch_size` 1); the session keeps every
per-sequence quantity (length, cache, states, random stream) on itself so that a batch is a list of sessions'
rows later, not a rewrite.
"""

from __future__ import annotations

import numpy as np

from specbuild import engine_format as ef
from specbuild.runtime.drafter import Proposal
from specbuild.runtime.kv_cache import MIN_CAPACITY, GrowingCache

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_}


class Session:
    def __init__(self, engine, expected_tokens: int, sampling, rng):
        """expected_tokens: prompt + one step's tokens; the cache starts at the next power of two and grows."""
        self.engine = engine
        self.sampling = sampling
        self.rng = rng
        pad = engine.scratch_rows  # scratch rows the graph writes after each call's tokens
        self.pad = pad
        expected_tokens += pad
        capacity = min(engine.max_seq_len + pad, max(MIN_CAPACITY, 1 << (expected_tokens - 1).bit_length()))
        self.kv = engine.new_kv(capacity)
        self.states = self._new_states(capacity)
        self._constant_feeds = {  # the same every call
            ef.TEMPERATURE: np.array([sampling.temperature], dtype=np.float32),
            ef.TOP_K: np.array([sampling.top_k], dtype=np.int64),
            ef.TOP_P: np.array([sampling.top_p], dtype=np.float32),
            ef.MIN_ROWS: np.zeros(engine.min_rows, dtype=np.bool_),  # read by step-padded graphs only
        }
        self.engine_s = 0.0  # time inside the engine, all calls

    @property
    def length(self) -> int:
        """Tokens in the KV cache."""
        return self.kv.length

    def fits(self, size: int) -> bool:
        return self.kv.length + size <= self.engine.max_seq_len

    def prefill(self, ids: list[int], window: int = 1) -> dict:
        """Run the prompt (its last `window` positions get logits); the first token is accepted from it."""
        t = len(ids)
        out = self._call(
            np.array([ids], dtype=np.int64),
            np.arange(t, dtype=np.int64)[None],
            np.tril(np.ones((t, t), dtype=np.bool_))[None],
            np.array([[[t - 1]]], dtype=np.int64),
            window,
        )
        self.kv.commit(out, None, t)
        self._update_states(out, None)
        return out

    def verify(self, proposal: Proposal) -> dict:
        """One engine call on the proposed tree, then commit the accepted nodes' KV and state."""
        size = proposal.size
        self.kv.ensure(self.kv.length + size + self.pad)
        for cache in self.states.values():
            if isinstance(cache, GrowingCache):
                cache.ensure(cache.length + size)
        positions = np.add(proposal.offsets, self.kv.length, dtype=np.int64)[None]
        out = self._call(proposal.tokens, positions, proposal.mask, proposal.paths, size)
        nodes = out[ef.ACCEPTED_NODES][0, : int(out[ef.NUM_ACCEPTED][0])]
        self.kv.commit(out, nodes, size)
        self._update_states(out, nodes)
        return out

    # ------------------------------------------------------------------ internals
    def _call(self, input_ids, position_ids, tree_mask, paths, window: int) -> dict:
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
        out = self.engine.backend.run(feeds, self.kv.aliases, self.kv.feeds())
        self.engine_s += self.engine.backend.last_engine_s
        return out

    def _new_states(self, capacity: int) -> dict:
        engine, states = self.engine, {}
        for spec in engine.state_specs:
            dtype = NUMPY_DTYPES.get(spec["dtype"], engine.kv_dtype)
            if spec["dtype"] == "float32" and engine.kv_dtype == np.float16:
                dtype = np.float16
            shape = [1 if d == "B" else (0 if d == "C" else d) for d in spec["shape"]]
            if spec.get("grow_axis") is not None:
                states[spec["name"]] = GrowingCache(
                    tuple(shape), spec["grow_axis"], dtype, engine.max_seq_len, capacity
                )
            else:
                states[spec["name"]] = np.full(shape, spec.get("fill", 0), dtype=dtype)
        return states

    def _update_states(self, out: dict, nodes: np.ndarray | None) -> None:
        for name, cache in self.states.items():
            if isinstance(cache, GrowingCache):
                cache.commit(out[ef.NEW_STATE_PREFIX + name], nodes)
            else:
                self.states[name] = out[ef.NEXT_STATE_PREFIX + name]
