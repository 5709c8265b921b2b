"""Head converter for `--eagle-dir` (EAGLE-1/2): published heads -> canonical tensors (checks shared with EAGLE-3
in specbuild.plugins.feature_draft.convert).

EAGLE-1/2 (`pytorch_model.bin`, `model.safetensors` or sharded; keys optionally prefixed `model.` / `ea_layer.`).
Canonical tensors:
  fc.weight [H,2H], fc.bias [H] (opt), layers.{i}.self_attn.{q,k,v,o}_proj.weight,
  layers.{i}.self_attn.{q,k,v}_proj.bias (opt, Qwen2), layers.{i}.mlp.{gate,up,down}_proj.weight,
  layers.{i}.post_attention_layernorm.weight, layers.{i}.input_layernorm.weight (i > 0 only), embed_tokens.weight
  [V,H] (opt: absent or equal to the base embedding -> the base embedding is used), and with a reduced/own vocab
  projection `lm_head.weight [Vd,H]` plus `d2t [Vd]` int64 (draft id j -> target id j + d2t[j]);
  otherwise the base lm_head is shared.
  head_cfg: version 1, num_layers, fc_bias, qkv_bias, num_heads, num_kv_heads, head_dim, intermediate_size,
  rms_norm_eps, rope_theta, rope_scaling, has_embed, draft_vocab_size (int or None), source, defaults.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specbuild.builder.checkpoint.canonical import recorded_defaults
from specbuild.errors import SpecbuildError
from specbuild.plugins.feature_draft.convert import (
    BASE_EMBED,
    HEAD_PREFIXES,
    LAYER_KEY,
    HeadTensors,
    base_lm_head,
    check_vocab_map,
    draft_dims,
    fmt_shape,
    read_head,
    same_tensor,
    strip_prefixes,
)

log = logging.getLogger(__name__)


def convert_eagle(head_dir: Path, model, base: dict, base_dir: Path | None = None) -> tuple[dict, dict]:
    """EAGLE-1/2 heads (SafeAILab `ea_layer` state dicts), any number of layers."""
    head_dir = Path(head_dir)
    raw, source, cfg = read_head(head_dir)
    tensors, shown = strip_prefixes(raw, HEAD_PREFIXES, source)
    src = HeadTensors(tensors, shown, source)
    h, vocab = model.hidden_size, model.vocab_size
    out: dict[str, torch.Tensor] = {}

    out["fc.weight"] = src.take("fc.weight", (h, 2 * h), f"hidden_size {h} of the base model")
    fc_bias = src.take("fc.bias", (h,), f"hidden_size {h} of the base model", optional=True)
    if fc_bias is not None:
        out["fc.bias"] = fc_bias
    layer_ids = {int(m[1]) for k in src.tensors if (m := LAYER_KEY.match(k))}
    if not layer_ids:
        raise SpecbuildError(f"{source}: holds no EAGLE decoder layer (no layers.0.* tensors)")
    num_layers = max(layer_ids) + 1
    if cfg.get("num_hidden_layers") not in (None, num_layers):
        log.info(
            "%s: config.json says num_hidden_layers %s, the tensors hold %d layers; using %d",
            head_dir,
            cfg.get("num_hidden_layers"),
            num_layers,
            num_layers,
        )
    dims = draft_dims(cfg, model, h)
    q_out, kv_out = dims["num_heads"] * dims["head_dim"], dims["num_kv_heads"] * dims["head_dim"]
    inter = dims["intermediate_size"]
    attn_why = (
        f"num_attention_heads {dims['num_heads']}, num_key_value_heads {dims['num_kv_heads']}, "
        f"head_dim {dims['head_dim']}, hidden_size {h}"
    )
    qkv_bias = src.has("layers.0.self_attn.q_proj.bias")
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes = {"q_proj": (q_out, h), "k_proj": (kv_out, h), "v_proj": (kv_out, h), "o_proj": (h, q_out)}
        for proj, shape in shapes.items():
            out[f"{p}self_attn.{proj}.weight"] = src.take(f"{p}self_attn.{proj}.weight", shape, attn_why)
        for proj in ("q_proj", "k_proj", "v_proj"):
            bias = src.take(f"{p}self_attn.{proj}.bias", (shapes[proj][0],), attn_why, optional=not qkv_bias)
            if bias is not None:
                out[f"{p}self_attn.{proj}.bias"] = bias
        mlp_why = f"intermediate_size {inter}, hidden_size {h}"
        for proj, shape in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
            out[f"{p}mlp.{proj}.weight"] = src.take(f"{p}mlp.{proj}.weight", shape, mlp_why)
        out[f"{p}post_attention_layernorm.weight"] = src.take(f"{p}post_attention_layernorm.weight", (h,))
        if i > 0:
            out[f"{p}input_layernorm.weight"] = src.take(f"{p}input_layernorm.weight", (h,))
        elif src.has(f"{p}input_layernorm.weight"):
            raise SpecbuildError(
                f"{source}: unexpected tensor {src.name(p + 'input_layernorm.weight')}: "
                "EAGLE's first draft layer has no input_layernorm"
            )

    embed = src.take(
        "embed_tokens.weight", (vocab, h), f"vocab_size {vocab}, hidden_size {h} of the base model", optional=True
    )
    if embed is not None and not same_tensor(embed, base.get(BASE_EMBED)):
        out["embed_tokens.weight"] = embed

    draft_vocab = None
    d2t, t2d = src.take_index("d2t"), src.take_index("t2d")
    if d2t is not None:
        vd = int(d2t.shape[0]) if d2t.dim() == 1 else -1
        if not src.has("lm_head.weight"):
            raise SpecbuildError(
                f"{source}: tensor {src.name('d2t')} needs the reduced vocab projection "
                f"lm_head.weight (shape {fmt_shape((max(vd, 0), h))}), which is missing"
            )
        lm_head = src.tensors["lm_head.weight"]
        vd = int(lm_head.shape[0])
        out["lm_head.weight"] = src.take("lm_head.weight", (vd, h), f"hidden_size {h} of the base model")
        out["d2t"] = check_vocab_map(src, d2t, t2d, vd, vocab)
        draft_vocab = vd
    elif t2d is not None:
        raise SpecbuildError(f"{source}: tensor {src.name('t2d')} without d2t: the draft-to-target map is missing")
    elif src.has("lm_head.weight"):
        lm_head = src.take("lm_head.weight", (vocab, h), f"vocab_size {vocab}, hidden_size {h} of the base model")
        if not same_tensor(lm_head, base_lm_head(base)):  # a copy of the base lm_head (vLLM's conversion) is dropped
            out["lm_head.weight"] = lm_head
            out["d2t"] = torch.zeros(vocab, dtype=torch.int64)
            draft_vocab = vocab
    src.check_consumed("an EAGLE-1/2 head")

    head_cfg = {
        "version": 1,
        "num_layers": num_layers,
        "fc_bias": fc_bias is not None,
        "qkv_bias": qkv_bias,
        **{k: dims[k] for k in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size")},
        "rms_norm_eps": dims["rms_norm_eps"],
        "rope_theta": dims["rope_theta"],
        "rope_scaling": dims["rope_scaling"],
        "has_embed": "embed_tokens.weight" in out,
        "draft_vocab_size": draft_vocab,
        "source": str(head_dir),
        "defaults": recorded_defaults(cfg, head_dir / "config.json"),
    }
    return head_cfg, out
