"""One engine call for many sequences: the batch's KV slots, the padded inputs of its rows, and the commit of what
each row accepted.

A `Sequence` is one request's own state outside the caches: sampling settings, random numbers, drafter, the last
call's result. A `Batch` holds the caches of the sequences in it (runtime/slots.py: row i = slot i) and runs one
call in which row i verifies `calls[i]` -- a prompt chunk or a proposed tree -- each after its own committed
length. Rows are padded to the longest row's T tokens (copies of the row's last token after it, at the next
positions, seeing only themselves: their outputs are never read and their KV lands in scratch slots); each row's
uniform numbers are its own (per sequence position, see Sequence.uniforms), so a row's tokens do not depend on
the other rows. Each call is decoded once into one StepResult per row; host work is O(accepted tokens) per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from specbuild import engine_format as ef
from specbuild.runtime.drafter import Drafter, Proposal, StepResult
from specbuild.runtime.layout import Layout
from specbuild.runtime.sampling import position_uniforms
from specbuild.runtime.slots import StateSlots, new_slots


@dataclasses.dataclass(frozen=True)
class Call:
    """What one row of a call verifies: tokens [N] (root first), mask [N,N], offsets [N] (position offsets from the
    row's length), paths [NP,DP] (-1 padded). window: the last `window` tokens get logits and acceptance (N for a
    tree; 1 for a prompt chunk). every_node: commit every token (a prompt) instead of the accepted nodes."""

    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    paths: np.ndarray
    window: int
    every_node: bool

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def prompt(cls, ids, window: int = 1) -> Call:
        t = len(ids)
        return cls(
            np.asarray(ids, dtype=np.int64),
            np.tril(np.ones((t, t), dtype=np.bool_)),
            np.arange(t, dtype=np.int64),
            np.array([[t - 1]], dtype=np.int64),
            window,
            True,
        )

    @classmethod
    def tree(cls, proposal: Proposal) -> Call:
        return cls(
            proposal.tokens[0],
            proposal.mask[0],
            proposal.offsets,
            proposal.paths[0],
            proposal.size,
            False,
        )


class Sequence:
    """One sequence: sampling settings, random numbers, drafter and last result (its caches live in a Batch)."""

    def __init__(self, layout: Layout, sampling, drafter: Drafter | None = None):
        self.sampling = sampling
        self.drafter = drafter
        self.last: StepResult | None = None
        self.engine_s = 0.0  # time of the engine calls this sequence took part in
        self.long_rope = False  # rotated with LongRoPE's long factors (ef.ROPE_LONG; the scheduler sets it)
        self._per_position = layout.per_position_uniforms
        self._greedy = sampling.temperature <= 0
        self._rng = np.random.default_rng(sampling.seed)
        self._table = None
        self._table_size = layout.max_seq_len + 1
        if self._per_position:
            self._bonus_rng = np.random.default_rng([sampling.seed, 1])

    def uniforms(self, positions: np.ndarray) -> np.ndarray:
        """Uniform numbers for the tokens that would take `positions`: with per-position uniforms (engines built
        for batching) number q of the request's own stream, whatever the call; else the next draws (older graphs)."""
        if not self._per_position:
            return self._rng.random(len(positions), dtype=np.float32)
        if self._greedy:
            return np.zeros(len(positions), dtype=np.float32)
        if self._table is None:
            self._table = position_uniforms(self.sampling.seed, self._table_size)
        return self._table[np.minimum(positions, self._table_size - 1)]

    def bonus_uniform(self) -> float:
        """The bonus draw of typical acceptance (and older graphs' residual draw)."""
        rng = self._bonus_rng if self._per_position else self._rng
        return float(rng.random(dtype=np.float32))


# outputs with one entry per acceptance-window token: a row's are cut to its own tokens (padding rows dropped)
WINDOW_OUTPUTS = (ef.LOGITS, ef.ROW_TOP_TOKENS, ef.ROW_TOP_K)


class RowOutputs(Mapping):
    """Row `row` of a batched call's outputs, each with a batch axis of 1 (what a drafter reads)."""

    def __init__(self, outputs: Mapping, row: int, logits_rows: int):
        self._outputs, self._row, self._logits_rows = outputs, row, logits_rows

    def __getitem__(self, name):
        value = self._outputs[name]
        if name in WINDOW_OUTPUTS:
            return value[self._row : self._row + 1, : self._logits_rows]
        return value[self._row : self._row + 1]

    def __iter__(self):
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    def __contains__(self, name) -> bool:
        return name in self._outputs


class Batch:
    """The KV slots of up to `slots` sequences and one engine call for all of them."""

    def __init__(self, layout: Layout, backend, slots: int, capacity: int):
        self.layout = layout
        self.backend = backend
        self.kv = new_slots(layout, slots, capacity, backend.bind)
        self.states = StateSlots(layout, capacity)
        self.sequences: list[Sequence] = []
        self.engine_s = 0.0
        self.calls = 0
        self._zero_probs: np.ndarray | None = None  # the draft_probs input of graphs that take one (see _feeds)

    @property
    def size(self) -> int:
        return len(self.sequences)

    @property
    def slots(self) -> int:
        return self.kv.slots

    def memory(self) -> tuple[int, int]:
        """Bytes of the KV cache and mode states held (the shared cache's written pages), and the most they can
        hold (every slot at max capacity)."""
        kv, kv_bound = self.kv.memory()
        states, states_bound = self.states.memory(self.slots)
        return kv + states, kv_bound + states_bound

    def length(self, seq: Sequence) -> int:
        """Tokens in `seq`'s KV slot."""
        return self.kv.lengths[self.sequences.index(seq)]

    def lengths(self) -> list[int]:
        return list(self.kv.lengths)

    def add(self, seq: Sequence, staged: Batch | None = None) -> None:
        """`seq` joins as the last row: an empty slot, or its caches copied from the one row of `staged` (where its
        prompt was prefilled)."""
        self.kv.add(staged.kv if staged is not None else None)
        self.states.add(staged.states if staged is not None else None)
        self.sequences.append(seq)

    def remove(self, seq: Sequence) -> None:
        """`seq` leaves; the last row moves into its slot."""
        row = self.sequences.index(seq)
        self.kv.remove(row)
        self.states.remove(row)
        last = self.sequences.pop()
        if row < len(self.sequences):
            self.sequences[row] = last

    def run(self, calls: list[Call], draft: bool = True) -> list[StepResult]:
        """One engine call: row i verifies calls[i] after its committed tokens; commits what each row accepted.
        draft=False: a graph that drafts per row (layout.selects_rows) drafts no next tree (plain decoding)."""
        n = len(calls)
        if n != len(self.sequences) or n == 0:
            raise ValueError(f"a call needs one entry per sequence of the batch ({len(self.sequences)}), got {n}")
        t = max(c.size for c in calls)
        if n == 1:
            w = calls[0].window
        elif any(c.window != c.size for c in calls):
            raise ValueError("rows of a batched call verify whole trees (window = every token)")
        else:
            w = t
        lengths = self.kv.lengths
        # the graph's KV cache and growing states share one capacity dimension (C): they grow together
        needed = max(lengths) + t + self.layout.scratch_rows
        self.kv.ensure(needed)
        self.states.ensure(needed)
        self.kv.wrote(t + self.layout.scratch_rows)
        feeds = self._feeds(calls, t, w, lengths)
        feeds[ef.DRAFT_ROWS] = np.arange(n if draft else 0, dtype=np.int64)
        feeds.update(self.states.feeds())
        out = self.backend.run(feeds, self.kv.aliases, self.kv.feeds())
        seconds = self.backend.last_engine_s
        self.engine_s += seconds
        self.calls += 1
        num, tokens, accepted_nodes = out[ef.NUM_ACCEPTED], out[ef.ACCEPTED_TOKENS], out[ef.ACCEPTED_NODES]
        results = []
        for row, (seq, call) in enumerate(zip(self.sequences, calls)):
            count = int(num[row])
            nodes = None if call.every_node else accepted_nodes[row, :count]
            self.kv.commit(row, out, nodes, call.size)
            self.states.commit(row, out, nodes, call.size)
            seq.engine_s += seconds
            seq.last = StepResult(tokens[row, :count].tolist(), nodes, RowOutputs(out, row, call.size - (t - w)))
            results.append(seq.last)
        return results

    def _draft_probs(self, n: int, w: int) -> np.ndarray:
        """[n,w,V] zeros, kept between calls of the same shape (the graph only reads it): the ef.DRAFT_PROBS input of
        draft-target graphs built before drafts were coupled to the target's draws (they accepted against a q). Their
        rows now carry greedy drafts or, sampled, roots alone: neither's acceptance depends on q."""
        shape = (n, w, self.layout.draft_probs_vocab)
        if self._zero_probs is None or self._zero_probs.shape != shape:
            self._zero_probs = np.zeros(shape, dtype=np.float32)
        return self._zero_probs

    def _feeds(self, calls: list[Call], t: int, w: int, lengths: list[int]) -> dict:
        n = len(calls)
        np_max = max(c.paths.shape[0] for c in calls)
        dp_max = max(c.paths.shape[1] for c in calls)
        ids = np.empty((n, t), dtype=np.int64)
        positions = np.empty((n, t), dtype=np.int64)
        mask = np.zeros((n, t, t), dtype=np.bool_)
        paths = np.full((n, np_max, dp_max), -1, dtype=np.int64)
        rand_accept = np.zeros((n, w), dtype=np.float32)
        rand_sample = np.empty(n, dtype=np.float32)
        temperature = np.empty(n, dtype=np.float32)
        top_k = np.empty(n, dtype=np.int64)
        top_p = np.empty(n, dtype=np.float32)
        pad = np.arange(t)
        for row, (seq, call) in enumerate(zip(self.sequences, calls)):
            size, past = call.size, lengths[row]
            ids[row, :size] = call.tokens
            ids[row, size:] = call.tokens[-1]
            positions[row, :size] = past + call.offsets
            positions[row, size:] = past + pad[size:]
            mask[row, :size, :size] = call.mask
            mask[row, pad[size:], pad[size:]] = True
            np_row, dp_row = call.paths.shape
            paths[row, :np_row, :dp_row] = call.paths
            paths[row, np_row:, :dp_row] = call.paths[0]
            first = t - w  # window rows [t - w, size) are real
            rand_accept[row, : size - first] = seq.uniforms(positions[row, first:size] + 1)
            rand_sample[row] = seq.bonus_uniform()
            sampling = seq.sampling
            temperature[row], top_k[row], top_p[row] = sampling.temperature, sampling.top_k, sampling.top_p
        rows = n * t
        feeds = {}
        if self.layout.rope_switch is not None:  # LongRoPE: the rows rotated with the long factors
            feeds[ef.ROPE_LONG] = np.fromiter((s.long_rope for s in self.sequences), dtype=np.bool_, count=n)
        if self.layout.draft_probs_vocab:  # an older draft-target graph's q input (never read now)
            feeds[ef.DRAFT_PROBS] = self._draft_probs(n, w)
        return feeds | {
            ef.INPUT_IDS: ids,
            ef.POSITION_IDS: positions,
            ef.TREE_MASK: mask,
            ef.PAST_LENGTH: np.asarray(lengths, dtype=np.int64),
            ef.PATHS: paths,
            ef.TEMPERATURE: temperature,
            ef.TOP_K: top_k,
            ef.TOP_P: top_p,
            ef.RAND_ACCEPT: rand_accept,
            ef.RAND_SAMPLE: rand_sample,
            # step padding (row-invariant kernels): a call of fewer rows than min_rows is padded to min_rows
            ef.MIN_ROWS: np.zeros(self.layout.min_rows if rows < self.layout.min_rows else 1, dtype=np.bool_),
        }
