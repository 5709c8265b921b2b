"""Decoder-layer features a mode trains on, declared by the mode (`LayerFeatures`, named by its ModeSpec's
`features`): which base layers' inputs (the residual stream entering the layer, HF hidden_states[i]) and under
which shard keys. They come out of the data stage's decoding pass (`distill.generate_sequences`) or of a separate
forward pass (`distill.extract_layer_features`); shards hold the declared keys [N, H] float16 (float32 where a value
is beyond float16's range: `stored`) and `token` (x_{p+1}), `seq`, `pos` (absolute position p) per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

FLOAT16_MAX = 65504.0


def stored(x):
    """Feature rows (a torch tensor) as a shard keeps them, on the CPU: float16, or float32 where a value is beyond
    float16's range (Gemma's residual stream passes 1e5; float16 would store inf and the training loss turn NaN)."""
    import torch

    x = x.detach()
    if x.numel() and float(x.abs().max()) > FLOAT16_MAX:
        return x.to(torch.float32).cpu()
    return x.to(torch.float16).cpu()


@dataclasses.dataclass(frozen=True)
class LayerFeatures:
    keys: tuple[str, ...]  # shard keys, one per captured layer
    layers: Callable[[int], list[int]]  # base layer count -> the indices of the captured layers (one per key)
