"""Checkpoints that store fused projections, read as the separate tensors of the canonical checkpoint.

Phi-3 (and Phi-4-mini) keep each layer's query, key and value projections in one `self_attn.qkv_proj.weight`
[(Hq + 2 Hkv) D, H] and the MLP's gate and up projections in one `mlp.gate_up_proj.weight` [2 I, H] (gate first, as
transformers' Phi3MLP chunks it). `unfuse` splits them by rows at convert time, one tensor read at a time, so the rest
of specbuild sees the q/k/v and gate/up tensors of a Llama-family layer (the step graph packs them again).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.checkpoint.weights_io import LazyTensors, spec_of
from specbuild.errors import SpecbuildError

FUSED_ARCHITECTURES = ("phi3",)


def fused_parts(model: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """{fused tensor name: [(part name, rows), ...] in row order} of `model`'s layers (none for most architectures)."""
    if model.architecture not in FUSED_ARCHITECTURES:
        return {}
    q, kv, inter = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.intermediate_size
    out = {}
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        attn = [(f"{p}self_attn.{n}_proj.weight", rows) for n, rows in (("q", q), ("k", kv), ("v", kv))]
        out[f"{p}self_attn.qkv_proj.weight"] = attn
        out[f"{p}mlp.gate_up_proj.weight"] = [(f"{p}mlp.gate_proj.weight", inter), (f"{p}mlp.up_proj.weight", inter)]
    return out


def unfuse(model: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str) -> Mapping[str, torch.Tensor]:
    """`tensors` (lazy or not) with each fused projection replaced by its parts, read when asked for (each read of a
    part reads its fused tensor); the mapping itself when the architecture fuses nothing. A fused tensor missing or
    of the wrong shape is one error naming it."""
    fused = fused_parts(model)
    if not fused:
        return tensors
    specs = {name: spec_of(tensors, name) for name in tensors if name not in fused}
    where: dict[str, tuple[str, int, int]] = {}  # part -> (fused name, first row, rows)
    for name, parts in fused.items():
        if name not in tensors:
            raise SpecbuildError(
                f"{source}: tensor {name} is missing (a {model.architecture} layer's fused projection)"
            )
        shape, dtype = spec_of(tensors, name)
        rows = sum(n for _, n in parts)
        if len(shape) != 2 or shape != (rows, model.hidden_size):
            raise SpecbuildError(
                f"{source}: tensor {name} has shape {tuple(shape)}, expected ({rows}, {model.hidden_size}) from "
                "config.json"
            )
        start = 0
        for part, n in parts:
            specs[part] = ((n, shape[1]), dtype)
            where[part] = (name, start, n)
            start += n

    def load(name: str) -> torch.Tensor:
        if name not in where:
            return tensors[name]
        fused_name, start, n = where[name]
        return tensors[fused_name].narrow(0, start, n).clone()  # its own storage: not a view of the fused tensor

    return LazyTensors(specs, load)
