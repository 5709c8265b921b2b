"""KV slots: the caches of the sequences one engine call advances, one slot (batch row) per sequence.

Every cache the step graph reads per sequence -- the base model's KV cache and the mode's states (EAGLE's draft KV)
-- has a slot axis (the graph's batch axis B) and, for caches of positions, a position axis whose capacity C is
shared by the slots and doubles when full (amortised O(1); the copy happens on growth only). Slot i holds the
sequence of batch row i; the rows in use are always the first n, so a call feeds the caches whole:
- the shared KV cache (the fused ONNX Runtime graph writes the new tokens in place) is allocated for every slot up
  front, [L,2,S,Hkv,C,D]; layer l's key / value are fed as views of the first n slots (contiguous: the slot axis
  leads inside a layer's buffer);
- every other cache (the portable graph's stacked KV [L,2,B,...], mode states) holds exactly the n slots in use:
  a sequence joining or leaving resizes it (one copy of that cache, on that event only, never per step).
A sequence leaving moves the last row into its slot (a copy of that sequence's committed positions, O(its length)).

After a call, `commit(row, nodes, count)` keeps a row's accepted tokens: O(accepted tokens) per row.

`memory()` gives the bytes a cache holds and the most it can hold (every slot at max capacity). The shared cache is
allocated whole but zero pages are not resident until written, so it counts what was written: per slot, the
furthest position a call reached since the buffer was made (rounded up to pages). That grows with the longest
sequence each slot has held (demand, bounded: the soak takes it out of the RSS it requires to stay flat).
"""

from __future__ import annotations

import mmap

import numpy as np

from specbuild import engine_format as ef
from specbuild.runtime.layout import Layout

MIN_CAPACITY = 256  # positions a cache starts with at least


def initial_capacity(layout: Layout, expected_tokens: int) -> int:
    """The capacity a cache starts with for `expected_tokens` (+ the scratch rows): the next power of two."""
    needed = expected_tokens + layout.scratch_rows
    return min(layout.max_capacity, max(MIN_CAPACITY, 1 << (needed - 1).bit_length()))


def _round_to_pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _axis_index(ndim: int, axis: int, index) -> tuple:
    key = [slice(None)] * ndim
    key[axis] = index
    return tuple(key)


class SlotArray:
    """A cache with a slot axis, holding exactly the slots in use; optionally a position axis (`pos_axis`) that
    grows by doubling up to `max_capacity`, with each slot's committed length."""

    def __init__(self, shape, slot_axis: int, pos_axis: int | None, dtype, capacity: int, max_capacity: int, fill=0):
        shape = list(shape)
        shape[slot_axis] = 0
        if pos_axis is not None:
            shape[pos_axis] = min(capacity, max_capacity)
        self.data = np.full(shape, fill, dtype=dtype)
        self.slot_axis, self.pos_axis = slot_axis, pos_axis
        self.max_capacity, self.fill = max_capacity, fill
        self.lengths: list[int] = []

    @property
    def capacity(self) -> int:
        return self.data.shape[self.pos_axis] if self.pos_axis is not None else 0

    def ensure(self, needed: int) -> None:
        """Room for `needed` positions in every slot (doubling; never beyond max_capacity)."""
        if self.pos_axis is None or needed <= self.capacity:
            return
        cap = max(self.capacity, 1)
        while cap < needed:
            cap *= 2
        cap = min(cap, self.max_capacity)
        if cap < needed:
            raise ValueError(f"cache needs {needed} positions but max capacity is {self.max_capacity}")
        shape = list(self.data.shape)
        shape[self.pos_axis] = cap
        grown = np.full(shape, self.fill, dtype=self.data.dtype)
        old = _axis_index(self.data.ndim, self.pos_axis, slice(0, self.capacity))
        grown[old] = self.data
        self.data = grown

    def add(self, source: SlotArray | None = None, row: int = 0) -> None:
        """A new last slot: empty, or a copy of `source`'s slot `row` (a sequence prefilled elsewhere)."""
        shape = list(self.data.shape)
        shape[self.slot_axis] = 1
        new = np.full(shape, self.fill, dtype=self.data.dtype)
        length = 0
        if source is not None:
            length = source.lengths[row] if self.pos_axis is not None else 0
            self.ensure(length)
            if self.pos_axis is not None:
                shape[self.pos_axis] = self.capacity
                new = np.full(shape, self.fill, dtype=self.data.dtype)
            src = source.data[_axis_index(source.data.ndim, source.slot_axis, slice(row, row + 1))]
            if self.pos_axis is not None:
                keep = _axis_index(new.ndim, self.pos_axis, slice(0, length))
                new[keep] = src[keep]
            else:
                new[...] = src
        self.data = np.concatenate([self.data, new], axis=self.slot_axis)
        self.lengths.append(length)

    def memory(self, slots: int) -> tuple[int, int]:
        """Bytes held (all written: np.full), and at most (`slots` slots, max capacity)."""
        shape = list(self.data.shape)
        shape[self.slot_axis] = slots
        if self.pos_axis is not None:
            shape[self.pos_axis] = self.max_capacity
        return self.data.nbytes, int(np.prod(shape)) * self.data.itemsize

    def remove(self, row: int) -> None:
        """Drop slot `row`; the last slot takes its place."""
        last = len(self.lengths) - 1
        if row != last:
            self._copy_slot(last, row)
            self.lengths[row] = self.lengths[last]
        self.data = np.ascontiguousarray(self.data[_axis_index(self.data.ndim, self.slot_axis, slice(0, last))])
        self.lengths.pop()

    def _copy_slot(self, src: int, dst: int) -> None:
        n = self.data.ndim
        if self.pos_axis is None:
            self.data[_axis_index(n, self.slot_axis, dst)] = self.data[_axis_index(n, self.slot_axis, src)]
            return
        key_src = [slice(None)] * n
        key_src[self.slot_axis], key_src[self.pos_axis] = src, slice(0, self.lengths[src])
        key_dst = list(key_src)
        key_dst[self.slot_axis] = dst
        self.data[tuple(key_dst)] = self.data[tuple(key_src)]

    def append(self, row: int, new: np.ndarray, nodes: np.ndarray | None) -> None:
        """Append slot `row`'s entries of a call's output `new` (batch on the slot axis, the call's tokens on the
        position axis) at `nodes` (all of them if None) after the slot's length."""
        entries = new[_axis_index(new.ndim, self.slot_axis, slice(row, row + 1))]
        if nodes is not None:
            entries = np.take(entries, nodes, axis=self.pos_axis)
        start, count = self.lengths[row], entries.shape[self.pos_axis]
        self.ensure(start + count)
        key = [slice(None)] * self.data.ndim
        key[self.slot_axis], key[self.pos_axis] = slice(row, row + 1), slice(start, start + count)
        self.data[tuple(key)] = entries
        self.lengths[row] = start + count

    def replace(self, row: int, new: np.ndarray) -> None:
        """Slot `row` of a state replaced whole every call: `new`'s row."""
        index = _axis_index(self.data.ndim, self.slot_axis, row)
        self.data[index] = new[index]


class SharedSlots:
    """The shared (in-place) KV cache for up to `slots` sequences: [L,2,S,Hkv,C,D]; the graph writes a call's T
    tokens of row i at [length_i, length_i + T) of slot i."""

    def __init__(self, layout: Layout, slots: int, capacity: int, bind=None):
        self.num_layers = layout.num_layers
        self.max_capacity = layout.max_capacity
        shape = (layout.num_layers, 2, slots, layout.kv_heads, min(capacity, self.max_capacity), layout.head_dim)
        self.data = np.zeros(shape, dtype=layout.kv_dtype)
        self.lengths: list[int] = []
        self.written = [0] * slots  # per slot: the furthest position written since self.data was made
        self.bind = bind or (lambda view: view)
        self._bound: tuple | None = None  # (data, n, feeds): the views of the last call, bound once
        layers = range(layout.num_layers)
        self.aliases = {ef.PRESENT_KEY.format(i): ef.PAST_KEY.format(i) for i in layers}
        self.aliases.update({ef.PRESENT_VALUE.format(i): ef.PAST_VALUE.format(i) for i in layers})

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    @property
    def slots(self) -> int:
        return self.data.shape[2]

    def ensure(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = self.capacity
        while cap < needed:
            cap *= 2
        cap = min(cap, self.max_capacity)
        if cap < needed:
            raise ValueError(f"KV cache needs {needed} positions but max capacity is {self.max_capacity}")
        # np.zeros leaves untouched pages unmapped: copying only the slots and positions in use keeps growth
        # O(committed tokens), not O(every slot x capacity) (measured: docs/benchmarks/design-measurements.md)
        grown = np.zeros((*self.data.shape[:4], cap, self.data.shape[5]), dtype=self.data.dtype)
        n, used = len(self.lengths), max(self.lengths, default=0)
        grown[:, :, :n, :, :used] = self.data[:, :, :n, :, :used]
        self.data = grown
        self.written = [used if i < n else 0 for i in range(self.slots)]

    def wrote(self, rows: int) -> None:
        """A call wrote `rows` positions (its tokens and scratch rows) after each slot's length."""
        for i, length in enumerate(self.lengths):
            self.written[i] = max(self.written[i], length + rows)

    def memory(self) -> tuple[int, int]:
        """Bytes written (resident: each (layer, key or value, slot, head) block's written positions, rounded up to
        pages), and the bytes of every slot at max capacity."""
        layers, kv, slots, heads, _, dim = self.data.shape
        blocks = layers * kv * heads
        position = dim * self.data.itemsize
        capacity = self.capacity
        held = blocks * sum(_round_to_pages(min(w, capacity) * position) for w in self.written)
        return min(held, self.data.nbytes), blocks * slots * self.max_capacity * position

    def feeds(self) -> dict:
        """past_key_i / past_value_i: views of the slots in use (wrapped once per buffer and count, see bind)."""
        n = len(self.lengths)
        if self._bound is None or self._bound[0] is not self.data or self._bound[1] != n:
            views = {}
            for i in range(self.num_layers):
                views[ef.PAST_KEY.format(i)] = self.bind(self.data[i, 0, :n])
                views[ef.PAST_VALUE.format(i)] = self.bind(self.data[i, 1, :n])
            self._bound = (self.data, n, views)
        return self._bound[2]

    def add(self, source=None, row: int = 0) -> None:
        n = len(self.lengths)
        if n == self.slots:
            raise ValueError(f"all {self.slots} KV slots are in use")
        length = 0
        if source is not None:
            length = source.lengths[row]
            self.ensure(length)
            self.data[:, :, n, :, :length] = source.data[:, :, row, :, :length]
            self.written[n] = max(self.written[n], length)
        self.lengths.append(length)

    def remove(self, row: int) -> None:
        last = len(self.lengths) - 1
        if row != last:
            length = self.lengths[last]
            self.data[:, :, row, :, :length] = self.data[:, :, last, :, :length]
            self.written[row] = max(self.written[row], length)
            self.lengths[row] = length
        self.lengths.pop()

    def commit(self, row: int, outputs: dict, nodes: np.ndarray | None, count: int) -> None:
        """The graph wrote `count` real tokens of row `row` at [length, length + count); keep `nodes` of them (all
        if None), moved down to [length, length + len(nodes)): O(accepted tokens)."""
        start = self.lengths[row]
        if nodes is not None:
            n = len(nodes)
            if n and int(nodes[-1]) != n - 1:  # increasing nodes 0..n-1 are already in place; others: copy down
                slot = self.data[:, :, row]  # a view [L,2,Hkv,C,D]: one index array keeps its axis in place
                slot[:, :, :, start : start + n] = slot[:, :, :, start + nodes]
            count = n
        self.lengths[row] = start + count


class StackedSlots:
    """The portable graph's KV cache, fed whole as `kv_cache` [L,2,B,Hkv,C,D]; `new_kv` [L,2,B,Hkv,T,D] holds a
    call's tokens, of which each row's accepted nodes are appended to its slot."""

    aliases: dict[str, str] = {}

    def __init__(self, layout: Layout, slots: int, capacity: int, bind=None):
        shape = (layout.num_layers, 2, 0, layout.kv_heads, 0, layout.head_dim)
        self.cache = SlotArray(shape, 2, 4, layout.kv_dtype, capacity, layout.max_capacity)
        self.slots = slots

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def ensure(self, needed: int) -> None:
        self.cache.ensure(needed)

    def wrote(self, rows: int) -> None:
        """Nothing to track: the cache holds exactly what it has (the graph returns new tokens apart)."""

    def memory(self) -> tuple[int, int]:
        return self.cache.memory(self.slots)

    def feeds(self) -> dict:
        return {ef.KV_CACHE: self.cache.data}

    def add(self, source=None, row: int = 0) -> None:
        if len(self.lengths) == self.slots:
            raise ValueError(f"all {self.slots} KV slots are in use")
        self.cache.add(source.cache if source is not None else None, row)

    def remove(self, row: int) -> None:
        self.cache.remove(row)

    def commit(self, row: int, outputs: dict, nodes: np.ndarray | None, count: int) -> None:
        new = outputs[ef.NEW_KV]
        if nodes is None:
            new = new[:, :, :, :, :count]
        self.cache.append(row, new, nodes)


def new_slots(layout: Layout, slots: int, capacity: int, bind=None) -> SharedSlots | StackedSlots:
    """The KV cache of `slots` sequences in the layout's form."""
    kind = SharedSlots if layout.shared_kv else StackedSlots
    return kind(layout, slots, capacity, bind)


class StateSlots:
    """The mode's states (engine.yaml `states`) of the slots in use: a growing state commits its accepted nodes like
    the KV cache (new_state_*), the others are replaced by the call's next_state_* rows."""

    def __init__(self, layout: Layout, capacity: int):
        self.arrays: dict[str, SlotArray] = {}
        for spec in layout.states:
            self.arrays[spec.name] = SlotArray(
                spec.shape, spec.batch_axis, spec.grow_axis, spec.dtype, capacity, layout.max_capacity, spec.fill
            )

    def ensure(self, needed: int) -> None:
        for array in self.arrays.values():
            array.ensure(needed)

    def feeds(self) -> dict:
        return {ef.STATE_PREFIX + name: array.data for name, array in self.arrays.items()}

    def memory(self, slots: int) -> tuple[int, int]:
        sizes = [array.memory(slots) for array in self.arrays.values()]
        return sum(held for held, _ in sizes), sum(bound for _, bound in sizes)

    def add(self, source: StateSlots | None = None, row: int = 0) -> None:
        for name, array in self.arrays.items():
            array.add(source.arrays[name] if source is not None else None, row)

    def remove(self, row: int) -> None:
        for array in self.arrays.values():
            array.remove(row)

    def commit(self, row: int, outputs: dict, nodes: np.ndarray | None, count: int) -> None:
        for name, array in self.arrays.items():
            if array.pos_axis is not None:
                new = outputs[ef.NEW_STATE_PREFIX + name]
                if nodes is None:
                    new = np.take(new, np.arange(count), axis=array.pos_axis)
                array.append(row, new, nodes)
            else:
                array.replace(row, outputs[ef.NEXT_STATE_PREFIX + name])
