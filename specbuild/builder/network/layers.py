"""Small torch layers shared by the network, its ONNX Runtime kernel forms and the draft networks."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, cos, sin):
    """x [..., D] rotated by cos/sin [..., R] (R = D, or the first R dims of each head under partial rotary, the rest
    passed through as transformers' Phi-3 does)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def stacked_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear computing the parts' outputs side by side ([x -> a|b|...]): their weights (and biases) stacked along
    the output axis, in the parts' dtype. Each output column is the same dot product as in its part."""
    first = parts[0]
    out_features = sum(p.out_features for p in parts)
    # made without its random initialisation (overwritten below; seconds at 7B scale), directly in the parts' dtype
    # and on their device (meta: the shapes alone, builder/network/lazy_network.py)
    device = first.weight.device
    lin = nn.utils.skip_init(
        nn.Linear, first.in_features, out_features, bias=first.bias is not None, dtype=first.weight.dtype, device=device
    )
    if device.type == "meta":
        return lin
    with torch.no_grad():
        lin.weight.copy_(torch.cat([p.weight for p in parts]))
        if lin.bias is not None:
            lin.bias.copy_(torch.cat([p.bias for p in parts]))
    return lin
