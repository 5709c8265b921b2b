"""What the head converters of feature-conditioned draft networks share: reading a head directory, checking tensors
by name and shape, the draft dimensions and the draft-to-target vocabulary map.

Everything is decided from the tensors, never from the head's config.json alone: the layer count (configs are known
to disagree with the weights), the presence of `fc.bias` (LLaMA-3 heads have none while the published config
default says they do) and of q/k/v biases. The draft config supplies head counts, head_dim, intermediate size, eps
and RoPE (defaulting to the base model's) and every tensor shape is checked against them; errors name the file and
the tensor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from specbuild.builder.checkpoint.canonical import read_json
from specbuild.builder.checkpoint.weights_io import find_weight_files, load_hf_weights
from specbuild.errors import SpecbuildError

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
HEAD_PREFIXES = ("ea_layer.", "model.")  # prefixes published heads put before the draft's tensor names
BASE_EMBED = "model.embed_tokens.weight"
BASE_LM_HEAD = "lm_head.weight"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


class HeadTensors:
    """The head's tensors under canonical names; take() checks and removes them, leftovers are unexpected."""

    def __init__(self, tensors: dict[str, torch.Tensor], shown: dict[str, str], source: str):
        self.tensors = tensors
        self.shown = shown  # canonical name -> the name in the file (what error messages print)
        self.source = source

    def name(self, key: str) -> str:
        return self.shown.get(key, key)

    def has(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str, shape: tuple[int, ...], why: str = "", optional: bool = False) -> torch.Tensor | None:
        tensor = self.tensors.pop(key, None)
        why = f" ({why})" if why else ""
        if tensor is None:
            if optional:
                return None
            raise SpecbuildError(
                f"{self.source}: tensor {self.name(key)} is missing (expected shape {fmt_shape(shape)}){why}"
            )
        if tuple(tensor.shape) != tuple(shape):
            raise SpecbuildError(
                f"{self.source}: tensor {self.name(key)} has shape {fmt_shape(tensor.shape)}, "
                f"expected {fmt_shape(shape)}{why}"
            )
        if not tensor.is_floating_point():
            raise SpecbuildError(
                f"{self.source}: tensor {self.name(key)} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
                "expected a floating-point dtype (quantized heads are not supported)"
            )
        return tensor

    def take_index(self, key: str) -> torch.Tensor | None:
        """An integer/bool vocab-mapping buffer (d2t, t2d), any length; None when absent."""
        return self.tensors.pop(key, None)

    def check_consumed(self, what: str) -> None:
        if self.tensors:
            extra = sorted(self.tensors)
            listed = ", ".join(f"{self.name(k)} (shape {fmt_shape(self.tensors[k].shape)})" for k in extra[:5])
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise SpecbuildError(
                f"{self.source}: unexpected tensor{'s' if len(extra) > 1 else ''} in {what}: {listed}{more}"
            )


def read_head(head_dir: Path) -> tuple[dict[str, torch.Tensor], str, dict]:
    files = find_weight_files(head_dir)
    source = str(files[0]) if len(files) == 1 else str(head_dir)
    raw = load_hf_weights(head_dir, progress=False)
    raw = {k: v for k, v in raw.items() if not k.endswith(IGNORED_SUFFIXES)}
    cfg_file = head_dir / "config.json"
    cfg = read_json(cfg_file) if cfg_file.is_file() else {}
    if not isinstance(cfg, dict):
        raise SpecbuildError(f"{cfg_file}: expected a JSON object")
    return raw, source, cfg


def strip_prefixes(raw: dict[str, torch.Tensor], prefixes: tuple[str, ...], source: str) -> tuple[dict, dict]:
    """Remove one leading prefix of `prefixes` from every key; returns (tensors, canonical -> file name)."""
    tensors, shown = {}, {}
    for key, value in raw.items():
        name = next((key[len(p) :] for p in prefixes if key.startswith(p)), key)
        if name in tensors:
            raise SpecbuildError(f"{source}: tensors {shown[name]} and {key} both name {name}")
        tensors[name], shown[name] = value, key
    return tensors, shown


def draft_dims(cfg: dict, model, hidden: int) -> dict[str, Any]:
    """Attention/MLP sizes and RoPE of the draft layer: the draft config's, else the base model's."""
    heads = int(cfg.get("num_attention_heads") or model.num_heads)
    kv_default = heads if cfg.get("num_attention_heads") else model.num_kv_heads
    head_dim = cfg.get("head_dim") or (hidden // heads if cfg.get("num_attention_heads") else model.head_dim)
    rope_theta = cfg.get("rope_theta", model.rope_theta)
    rope_scaling = cfg.get("rope_scaling") if "rope_scaling" in cfg else model.rope_scaling
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        rope_theta = params.get("rope_theta", rope_theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {
        "num_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or kv_default),
        "head_dim": int(head_dim),
        "intermediate_size": int(cfg.get("intermediate_size") or model.intermediate_size),
        "rms_norm_eps": float(cfg.get("rms_norm_eps") or model.rms_norm_eps),
        "rope_theta": float(rope_theta or model.rope_theta),
        "rope_scaling": dict(rope_scaling) if isinstance(rope_scaling, dict) else None,
    }


def check_vocab_map(src: HeadTensors, d2t: torch.Tensor, t2d: torch.Tensor | None, draft_vocab: int, vocab: int):
    """d2t [Vd] int: ids j + d2t[j] strictly increasing inside [0, V); t2d (if any) must mark exactly those ids."""
    name = src.name("d2t")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.dtype.is_complex:
        raise SpecbuildError(
            f"{src.source}: tensor {name} has dtype {str(d2t.dtype).removeprefix('torch.')}, "
            "expected an integer dtype (int64)"
        )
    if tuple(d2t.shape) != (draft_vocab,):
        raise SpecbuildError(
            f"{src.source}: tensor {name} has shape {fmt_shape(d2t.shape)}, expected {fmt_shape((draft_vocab,))} "
            "(one entry per draft-vocab row of lm_head.weight)"
        )
    d2t = d2t.to(torch.int64)
    mapped = torch.arange(draft_vocab, dtype=torch.int64) + d2t
    bad = ((mapped < 0) | (mapped >= vocab)).nonzero()
    if len(bad):
        j = int(bad[0])
        raise SpecbuildError(
            f"{src.source}: tensor {name} maps draft id {j} to target id {int(mapped[j])}, "
            f"outside the base vocabulary [0, {vocab})"
        )
    if draft_vocab > 1:
        steps = (mapped[1:] <= mapped[:-1]).nonzero()
        if len(steps):
            j = int(steps[0]) + 1
            raise SpecbuildError(
                f"{src.source}: tensor {name} maps draft ids {j - 1} and {j} to target ids "
                f"{int(mapped[j - 1])} and {int(mapped[j])}: target ids must be strictly increasing"
            )
    if t2d is not None:
        tname = src.name("t2d")
        if tuple(t2d.shape) != (vocab,):
            raise SpecbuildError(
                f"{src.source}: tensor {tname} has shape {fmt_shape(t2d.shape)}, expected {fmt_shape((vocab,))} "
                "(one entry per base-vocabulary token)"
            )
        marked = t2d.to(torch.bool).nonzero().flatten()
        if len(marked) != draft_vocab or not torch.equal(marked, mapped):
            raise SpecbuildError(
                f"{src.source}: tensors {tname} and {name} disagree: t2d marks {len(marked)} target ids, "
                f"d2t maps {draft_vocab} draft ids to a different set"
            )
    return d2t


def base_lm_head(base: dict) -> torch.Tensor:
    return base[BASE_LM_HEAD] if BASE_LM_HEAD in base else base[BASE_EMBED]


def same_tensor(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and torch.equal(a.to(b.dtype), b)


def sample_names(names, n: int = 6) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "") if names else "none"
