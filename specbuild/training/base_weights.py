"""The frozen base-model tensors a head trainer reads: token embedding, lm_head (the embedding when tied) and the
final norm weight, from the checkpoint's model.safetensors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch


@dataclasses.dataclass
class BaseWeights:
    embed: torch.Tensor  # [V, H] float32
    lm_head: torch.Tensor  # [V, H] float32
    final_norm: torch.Tensor  # [H] float32


def load_base_weights(hf_dir: str | Path) -> BaseWeights:
    from safetensors import safe_open

    with safe_open(str(Path(hf_dir) / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
        lm_head = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in f.keys() else embed
        return BaseWeights(embed, lm_head, f.get_tensor("model.norm.weight").float())


class BaseParts(torch.nn.Module):
    """The base tensors as frozen modules (`embed_tokens`, `lm_head`, the `final_norm` buffer), as draft networks
    call them."""

    def __init__(self, weights: BaseWeights):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding.from_pretrained(weights.embed, freeze=True)
        self.lm_head = torch.nn.Linear(weights.embed.shape[1], weights.lm_head.shape[0], bias=False)
        self.lm_head.weight = torch.nn.Parameter(weights.lm_head, requires_grad=False)
        self.register_buffer("final_norm", weights.final_norm, persistent=False)
