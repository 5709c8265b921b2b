"""Runtime-owned caches: capacity doubles when full (amortised O(1)); commits copy only accepted entries.

StackedKV and SharedKV hold the base model's KV cache for the two graph layouts (engine_format KV_STACKED / KV_SHARED)
behind one interface: feeds(), aliases (output -> input sharing a buffer), ensure(), commit(); `new_kv_cache` makes
the one a Layout names."""

from __future__ import annotations

import numpy as np

from specbuild import engine_format as ef

MIN_CAPACITY = 256


def new_kv_cache(layout, capacity: int, bind=None) -> StackedKV | SharedKV:
    """An empty cache for `layout` (runtime/layout.py). bind: wraps a shared buffer for the backend (Backend.bind)."""
    dims = (layout.num_layers, layout.kv_heads, layout.head_dim, layout.kv_dtype, layout.max_capacity, capacity)
    return SharedKV(*dims, bind=bind) if layout.shared_kv else StackedKV(*dims)


class GrowingCache:
    """A tensor whose axis `axis` holds positions: [..., C, ...]. `length` positions are valid."""

    def __init__(self, shape: tuple[int, ...], axis: int, dtype, max_capacity: int, capacity: int = MIN_CAPACITY):
        self.axis = axis
        self.max_capacity = max_capacity
        cap = min(max(capacity, 1), max_capacity)
        shape = list(shape)
        shape[axis] = cap
        self.data = np.zeros(shape, dtype=dtype)
        self.length = 0
        self.grow_count = 0

    @property
    def capacity(self) -> int:
        return self.data.shape[self.axis]

    def ensure(self, needed: int) -> None:
        """Make room for `needed` positions in total, doubling the capacity (never beyond max_capacity)."""
        if needed <= self.capacity:
            return
        cap = self.capacity
        while cap < needed:
            cap *= 2
        cap = min(cap, self.max_capacity)
        if cap < needed:
            raise ValueError(f"cache needs {needed} positions but max capacity is {self.max_capacity}")
        shape = list(self.data.shape)
        shape[self.axis] = cap
        grown = np.zeros(shape, dtype=self.data.dtype)
        index = [slice(None)] * self.data.ndim
        index[self.axis] = slice(0, self.length)
        grown[tuple(index)] = self.data[tuple(index)]
        self.data = grown
        self.grow_count += 1

    def commit(self, new: np.ndarray, nodes: np.ndarray | None = None) -> None:
        """Append `new`'s entries at `nodes` (all of them if None) along the position axis."""
        if nodes is not None:
            new = np.take(new, nodes, axis=self.axis)
        n = new.shape[self.axis]
        self.ensure(self.length + n)
        index = [slice(None)] * self.data.ndim
        index[self.axis] = slice(self.length, self.length + n)
        self.data[tuple(index)] = new
        self.length += n


class StackedKV:
    """The KV cache of a `stacked` graph: fed whole as `kv_cache`; the accepted nodes of `new_kv` are appended."""

    aliases: dict[str, str] = {}

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, max_capacity: int, capacity: int):
        self.cache = GrowingCache((num_layers, 2, 1, kv_heads, 0, head_dim), 4, dtype, max_capacity, capacity)
        self._feeds: dict = {}

    @property
    def length(self) -> int:
        return self.cache.length

    def ensure(self, needed: int) -> None:
        self.cache.ensure(needed)

    def feeds(self) -> dict[str, np.ndarray]:
        """The same mapping while the buffer is the same (the backend keeps it bound)."""
        if self._feeds.get(ef.KV_CACHE) is not self.cache.data:
            self._feeds = {ef.KV_CACHE: self.cache.data}
        return self._feeds

    def commit(self, outputs: dict, nodes: np.ndarray | None, count: int) -> None:
        self.cache.commit(outputs[ef.NEW_KV], nodes)


class SharedKV:
    """The KV cache of a `shared` graph: one buffer [L,2,1,Hkv,C,D]; layer i's key/value views are bound as both
    past_key_i / past_value_i and present_key_i / present_value_i, so the graph writes the step's T tokens in place
    at [length, length + T). commit() moves the accepted nodes down to [length, length + n): O(accepted tokens)."""

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, dtype, max_capacity: int, capacity: int, bind=None
    ):
        self.num_layers = num_layers
        self.bind = bind or (lambda view: view)  # e.g. the ONNX Runtime backend's BoundArray
        self._bound = None
        self.cache = GrowingCache((num_layers, 2, 1, kv_heads, 0, head_dim), 4, dtype, max_capacity, capacity)
        layers = range(num_layers)
        self.aliases = {ef.PRESENT_KEY.format(i): ef.PAST_KEY.format(i) for i in layers}
        self.aliases.update({ef.PRESENT_VALUE.format(i): ef.PAST_VALUE.format(i) for i in layers})

    @property
    def length(self) -> int:
        return self.cache.length

    def ensure(self, needed: int) -> None:
        self.cache.ensure(needed)

    def feeds(self) -> dict:
        """past_key_i / past_value_i: views of the buffer (wrapped once per buffer for the backend, see bind)."""
        data = self.cache.data
        if self._bound is None or self._bound[0] is not data:
            views = {}
            for i in range(self.num_layers):
                views[ef.PAST_KEY.format(i)] = self.bind(data[i, 0])
                views[ef.PAST_VALUE.format(i)] = self.bind(data[i, 1])
            self._bound = (data, views)
        return self._bound[1]

    def commit(self, outputs: dict, nodes: np.ndarray | None, count: int) -> None:
        """The graph wrote `count` tokens at [length, length + count); keep `nodes` of them (all if None)."""
        start = self.cache.length
        if nodes is not None:
            nodes = np.asarray(nodes)
            n = len(nodes)
            if n and int(nodes[-1]) != n - 1:  # increasing nodes 0..n-1 are already in place; others: copy down
                data = self.cache.data
                data[:, :, :, :, start : start + len(nodes)] = data[:, :, :, :, start + nodes]
            count = len(nodes)
        self.cache.length = start + count
