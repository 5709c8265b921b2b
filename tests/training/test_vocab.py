"""The one draft-vocabulary rule (specbuild.training.vocab): targets seen twice, most frequent first (ties to the lower
id), capped at `max_size`, filled up to `min_size` in the same order."""

import numpy as np

from specbuild.training.vocab import draft_vocabulary, frequent_targets

TARGETS = np.array([7] * 5 + [3] * 4 + [9] * 4 + [1] * 2 + [4])  # 4 is seen once


def test_the_targets_seen_twice_most_frequent_first_ties_to_the_lower_id():
    ids, counts = frequent_targets(TARGETS)
    assert ids.tolist() == [7, 3, 9, 1] and counts.tolist() == [5, 4, 4, 2]
    assert draft_vocabulary(TARGETS).tolist() == [1, 3, 7, 9]
    assert draft_vocabulary(TARGETS, max_size=3).tolist() == [3, 7, 9]
    assert draft_vocabulary(TARGETS, max_size=2).tolist() == [3, 7]  # 3 and 9 tie: the lower id stays
    assert draft_vocabulary(TARGETS, max_size=10).tolist() == [1, 3, 7, 9]


def test_a_floor_fills_with_ids_seen_once_then_never_in_the_same_order():
    ids, counts = frequent_targets(TARGETS, 12, min_size=7)
    assert ids.tolist() == [7, 3, 9, 1, 4, 0, 2] and counts.tolist() == [5, 4, 4, 2, 1, 0, 0]
    assert draft_vocabulary(TARGETS, vocab=12, min_size=7, max_size=5).tolist() == [1, 3, 4, 7, 9]  # the cap wins
    assert len(draft_vocabulary(TARGETS, vocab=12, min_size=50)) == 12  # at most the vocabulary
    assert draft_vocabulary(np.zeros(0, np.int64), vocab=5, min_size=3).tolist() == [0, 1, 2]
