"""KV slots: doubling growth, joins and leaves move only the leaving row's slot, commits copy only accepted entries."""

import numpy as np
import pytest

from specbuild import engine_format as ef
from specbuild.runtime.layout import Layout
from specbuild.runtime.slots import SharedSlots, SlotArray, StackedSlots


def _layout(kv_cache: str, max_seq_len: int = 64) -> Layout:
    return Layout(kv_cache, 2, 1, 3, np.float32, max_seq_len, 4, 1, 0, (), 4, True, False)


def _fill(slots, row: int, value: float, count: int, outputs_for) -> None:
    """Commit `count` positions of value `value` to `row` (through the layout's own commit path)."""
    slots.ensure(slots.lengths[row] + count + 1)
    slots.commit(row, outputs_for(row, value, count), None, count)


def _shared_writer(slots: SharedSlots):
    def outputs(row, value, count):
        start = slots.lengths[row]
        slots.data[:, :, row, :, start : start + count] = value + np.arange(count)[:, None]
        return {}

    return outputs


def _stacked_writer(slots: StackedSlots):
    def outputs(row, value, count):
        n = len(slots.lengths)
        new = np.zeros((2, 2, n, 1, count, 3), dtype=np.float32)
        new[:, :, row] = value + np.arange(count)[:, None]
        return {ef.NEW_KV: new}

    return outputs


def _two_rows(slots: int, capacity: int):
    """A shared cache of `slots` slots with two empty rows in use, and its writer."""
    cache = SharedSlots(_layout(ef.KV_SHARED), slots, capacity)
    cache.add()
    cache.add()
    return cache, _shared_writer(cache)


@pytest.mark.parametrize("kind", [ef.KV_SHARED, ef.KV_STACKED])
def test_rows_join_leave_and_keep_their_positions(kind):
    layout = _layout(kind)
    slots = (SharedSlots if kind == ef.KV_SHARED else StackedSlots)(layout, 3, 4)
    writer = (_shared_writer if kind == ef.KV_SHARED else _stacked_writer)(slots)
    for row, value in enumerate((10.0, 20.0, 30.0)):
        slots.add()
        _fill(slots, row, value, 3 + row, writer)
    with pytest.raises(ValueError, match="slots"):
        slots.add()
    assert slots.capacity == 8  # 4 doubled once (row 2 needed 5 + 1)
    slots.remove(0)  # the last row (30.x, 5 positions) moves into slot 0
    assert slots.lengths == [5, 4]
    data = slots.data if kind == ef.KV_SHARED else slots.cache.data
    assert np.array_equal(data[0, 0, 0, 0, :5, 0], 30.0 + np.arange(5))
    assert np.array_equal(data[0, 0, 1, 0, :4, 0], 20.0 + np.arange(4))


def test_shared_commit_moves_accepted_nodes_down():
    slots, writer = _two_rows(2, 16)
    _fill(slots, 1, 0.0, 2, writer)
    # the graph wrote 4 tree nodes of row 1 at [2, 6); nodes 0, 2, 3 are accepted
    slots.data[:, :, 1, :, 2:6] = np.array([100.0, 101.0, 102.0, 103.0])[:, None]
    slots.commit(1, {}, np.array([0, 2, 3]), 4)
    assert slots.lengths == [0, 5]
    assert np.array_equal(slots.data[0, 1, 1, 0, :5, 2], [0.0, 1.0, 100.0, 102.0, 103.0])


def test_feeds_are_views_of_the_rows_in_use_and_kept_while_unchanged():
    slots = SharedSlots(_layout(ef.KV_SHARED), 4, 8)
    slots.add()
    slots.add()
    feeds = slots.feeds()
    assert feeds[ef.PAST_KEY.format(1)].shape == (2, 1, 8, 3)
    assert feeds[ef.PAST_KEY.format(1)].flags.c_contiguous
    assert slots.feeds() is feeds  # the backend keeps them bound
    slots.add()
    assert slots.feeds()[ef.PAST_VALUE.format(0)].shape == (3, 1, 8, 3)


def test_state_array_grows_by_doubling_up_to_its_limit():
    state = SlotArray((1, 2, 1, 0), 2, 3, np.float32, capacity=4, max_capacity=10)
    state.add()
    new = np.ones((1, 2, 1, 9), dtype=np.float32)
    state.append(0, new, np.arange(9))
    assert state.capacity == 10 and state.lengths == [9]
    with pytest.raises(ValueError, match="max capacity"):
        state.append(0, new[..., :2], None)


def test_shared_growth_copies_only_the_committed_positions_of_slots_in_use():
    slots, writer = _two_rows(4, 4)
    _fill(slots, 0, 10.0, 2, writer)
    _fill(slots, 1, 20.0, 3, writer)
    slots.data[:, :, :2, :, 3:] = -1.0  # scratch after the longest committed length
    slots.data[:, :, 2:] = -1.0  # idle slots
    slots.ensure(7)
    assert slots.capacity == 8 and slots.lengths == [2, 3]
    assert np.array_equal(slots.data[0, 0, 0, 0, :2, 0], 10.0 + np.arange(2))
    assert np.array_equal(slots.data[1, 1, 1, 0, :3, 2], 20.0 + np.arange(3))
    assert not slots.data[:, :, :, :, 3:].any() and not slots.data[:, :, 2:].any()


def test_shared_memory_counts_the_written_pages_of_each_slot_and_its_bound_every_slot_full():
    # 1024 float32 per position: one position is one page (4 KiB), so the count is exact
    layout = Layout(ef.KV_SHARED, 2, 1, 1024, np.float32, 60, 4, 1, 4, (), 3, True, False)
    cache = SharedSlots(layout, 3, 16)
    page = 1024 * 4
    blocks = 2 * 2 * 1  # layers x (key, value) x heads
    assert cache.memory() == (0, blocks * 3 * layout.max_capacity * page)  # np.zeros: nothing resident yet
    cache.add()
    cache.add()
    cache.lengths[:] = [5, 2]
    cache.wrote(3 + layout.scratch_rows)  # a call of 3 tokens and 4 scratch rows after each length
    assert cache.written == [12, 9, 0]
    assert cache.memory()[0] == blocks * (12 + 9) * page
    cache.lengths[:] = [2, 2]
    cache.wrote(1)  # shorter than before: nothing new
    assert cache.memory()[0] == blocks * 21 * page
    cache.remove(0)  # the last row (2 positions) is copied into slot 0, which had more written already
    assert cache.written == [12, 9, 0]
    cache.add()
    cache.lengths[:] = [2, 14]
    cache.ensure(31)  # a new buffer: the first 14 positions of the slots in use are copied (written), no more
    assert cache.capacity == 32 and cache.written == [14, 14, 0]
    cache.wrote(20)
    assert cache.written == [22, 34, 0]
    assert cache.memory()[0] == blocks * (22 + 32) * page  # slot 1: the buffer's 32 positions at most


def test_shared_memory_rounds_a_blocks_written_positions_up_to_pages():
    layout = Layout(ef.KV_SHARED, 1, 2, 3, np.float32, 4000, 4, 1, 0, (), 2, True, False)
    cache = SharedSlots(layout, 2, 4096)
    cache.add()
    cache.wrote(1)  # 12 bytes in each of 1 x 2 x 2 blocks: one page each
    assert cache.memory()[0] == 4 * 4096


def test_stacked_memory_is_the_whole_array_and_its_bound_every_slot_full():
    layout = _layout(ef.KV_STACKED)
    cache = StackedSlots(layout, 3, 8)
    cache.add()
    cache.add()
    held, bound = cache.memory()
    assert held == cache.cache.data.nbytes == 2 * 2 * 2 * 1 * 8 * 3 * 4
    assert bound == 2 * 2 * 3 * 1 * layout.max_capacity * 3 * 4
