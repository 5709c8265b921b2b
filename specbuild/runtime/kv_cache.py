"""Runtime-owned caches: capacity doubles when full (amortised O(1)); commits copy only accepted entries."""

from __future__ import annotations

import numpy as np

MIN_CAPACITY = 256


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
