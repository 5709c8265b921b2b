"""GrowingCache: doubling growth, commits copy only the selected entries."""

import numpy as np
import pytest

from specbuild.runtime.kv_cache import GrowingCache


def test_commit_selected_nodes_and_double():
    cache = GrowingCache((2, 1, 0, 3), axis=2, dtype=np.float32, max_capacity=64, capacity=4)
    new = np.arange(2 * 1 * 5 * 3, dtype=np.float32).reshape(2, 1, 5, 3)
    cache.commit(new, np.array([0, 2, 4]))
    assert cache.length == 3 and cache.capacity == 4
    np.testing.assert_array_equal(cache.data[:, :, :3], new[:, :, [0, 2, 4]])
    cache.commit(new)  # 5 more -> 8 needed -> doubles to 8
    assert cache.capacity == 8 and cache.length == 8
    np.testing.assert_array_equal(cache.data[:, :, 3:8], new)
    np.testing.assert_array_equal(cache.data[:, :, :3], new[:, :, [0, 2, 4]])


def test_never_beyond_max_capacity():
    cache = GrowingCache((1, 0), axis=1, dtype=np.float32, max_capacity=6, capacity=4)
    cache.ensure(6)
    assert cache.capacity == 6
    with pytest.raises(ValueError):
        cache.ensure(7)
