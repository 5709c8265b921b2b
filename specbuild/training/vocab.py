"""Draft vocabularies: which training targets a drafter projects onto (a CPU draft's logits cover these ids only;
verification always uses the full vocabulary, so outputs never depend on them)."""

from __future__ import annotations

import numpy as np


def frequent_targets(targets: np.ndarray, vocab: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, counts) of the training targets seen at least twice, most frequent first, ties to the lower id
    (`vocab`: the least length of the counted id range)."""
    counts = np.bincount(np.asarray(targets, dtype=np.int64), minlength=vocab)
    ids = np.nonzero(counts >= 2)[0]
    order = np.lexsort((ids, -counts[ids]))
    return ids[order], counts[ids[order]]
