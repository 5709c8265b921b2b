"""Decoder-layer features a mode trains on, declared by the mode (`LayerFeatures`, named by its ModeSpec's
`features`): which base layers' inputs (the residual stream entering the layer, HF hidden_states[i]) and under
which shard keys. They come out of the data stage's decoding pass (`distill.generate_sequences`) or of a separate
forward pass (`distill.extract_layer_features`); shards hold the declared keys [N, H] float16 and `token` (x_{p+1}),
`seq`, `pos` (absolute position p) per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class LayerFeatures:
    keys: tuple[str, ...]  # shard keys, one per captured layer
    layers: Callable[[int], list[int]]  # base layer count -> the indices of the captured layers (one per key)
