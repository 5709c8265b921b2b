"""The held-out split every trainer uses: whole sequences, chosen by their (hash-derived) sequence number, so a
sequence stays on its side of the split when more data is added."""

from __future__ import annotations

import numpy as np


def heldout_mask(seq: np.ndarray, heldout_frac: float, seed: int = 0) -> np.ndarray:
    """True where the row (or sequence) numbered `seq` is held out."""
    key = (np.asarray(seq).astype(np.int64) + seed * 7919) % 10000
    return key < int(round(heldout_frac * 10000))
