"""Draft vocabularies: which training targets a drafter projects onto (a CPU draft's logits cover these ids only;
verification always uses the full vocabulary, so outputs never depend on them).

One rule for every head: the ids ordered by how often they are training targets, most frequent first, ties to the
lower id; the vocabulary is the targets seen at least MIN_COUNT times, at most `max_size` of them, and at least
`min_size` ids (the order goes on into ids seen once, then never: a head that drafts its top-k from the vocabulary
keeps room for it on a small training set). Heads ship it sorted by id (`draft_vocabulary`); the draft model keeps
the frequency order (its loss trains on a prefix)."""

from __future__ import annotations

import numpy as np

MIN_COUNT = 2  # a target seen once is as likely noise as a habit of the base model


def frequent_targets(
    targets: np.ndarray, vocab: int = 0, *, max_size: int | None = None, min_size: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, counts) of the draft vocabulary of `targets` (the module's rule), most frequent first, ties to
    the lower id; `vocab`: the least length of the counted id range (ids never seen fill up to `min_size` from it)."""
    counts = np.bincount(np.asarray(targets, dtype=np.int64), minlength=vocab)
    order = np.lexsort((np.arange(len(counts)), -counts))
    size = max(int((counts >= MIN_COUNT).sum()), min(int(min_size), len(counts)))
    ids = order[: size if max_size is None else min(size, int(max_size))]
    return ids, counts[ids]


def draft_vocabulary(
    targets: np.ndarray, *, vocab: int = 0, max_size: int | None = None, min_size: int = 0
) -> np.ndarray:
    """The ids of `frequent_targets`, sorted (the layout heads ship: `draft_vocab`, `d2t`)."""
    return np.sort(frequent_targets(targets, vocab, max_size=max_size, min_size=min_size)[0])
