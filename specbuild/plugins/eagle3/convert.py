"""Head converter for `--eagle3-dir` (EAGLE-3): published heads -> canonical tensors (checks shared with EAGLE-1/2
in specbuild.plugins.feature_draft.convert).

EAGLE-3, layout "original" (SafeAILab `midlayer.*`), "modelopt" (ModelOpt's native names `[eagle_module.]layers.0.*`,
`hidden_norm`, `input_embeds_norm`, `eagle_lm_head`; its exported checkpoints use the original names) or "speculators"
(vLLM's speculators format: config.json with `speculators_model_type: "eagle3"`, the draft layer's own config under
`transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`, `norm_before_residual`, optional
`eagle_aux_hidden_state_layer_ids`; tensors `layers.0.{self_attn,mlp,hidden_norm,input_layernorm,
post_attention_layernorm}.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, usually a copy of the base `embed_tokens`).
`norm_before_residual` (speculators/vLLM): the draft layer's residual is hidden_norm(x) instead of x; a speculators
config without the key gets vLLM's default (true), any other config the layer's default (false).
Canonical tensors:
  fc.weight [H,3Ht], midlayer.self_attn.{q,k,v}_proj.weight [*,2H], midlayer.self_attn.o_proj.weight,
  midlayer.mlp.{gate,up,down}_proj.weight, midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
  norm.weight, lm_head.weight [Vd,H], d2t [Vd] int64 (zeros = identity when Vd == V), embed_tokens.weight (opt).
  head_cfg: version 3, hidden_size, draft_vocab_size, target_hidden_size, num_heads, num_kv_heads, head_dim,
  intermediate_size, rms_norm_eps, rope_theta, rope_scaling, capture_layers, has_embed, norm_before_residual,
  layout, source, defaults.
  capture_layers are base decoder-layer indices whose *input* (pre-norm residual stream, HF hidden_states[i]) is
  captured, low -> mid -> high: EAGLE-3's [2, L//2, L-3] (clamped into [0, L-1] for toy models with few layers), or
  ModelOpt's `eagle_aux_hidden_state_layer_ids` (outputs of layer i = inputs of layer i+1; i+1 == L means the last
  layer's output before the final norm), or a speculators config's `eagle_aux_hidden_state_layer_ids` (vLLM's
  indexing: id i is the input of layer i already, L the last layer's output).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from specbuild.builder.checkpoint.canonical import recorded_defaults
from specbuild.errors import SpecbuildError
from specbuild.plugins.feature_draft.convert import (
    ATTN,
    BASE_EMBED,
    HEAD_PREFIXES,
    LAYER_KEY,
    MLP,
    HeadTensors,
    base_lm_head,
    check_vocab_map,
    draft_dims,
    fmt_shape,
    read_head,
    same_tensor,
    sample_names,
    strip_prefixes,
)

log = logging.getLogger(__name__)

MODELOPT_PREFIX = "eagle_module."
# ModelOpt's eagle_module names (single decoder layer) -> the SafeAILab EAGLE-3 names used canonically.
MODELOPT_TO_EAGLE3 = {
    **{f"layers.0.self_attn.{p}.weight": f"midlayer.self_attn.{p}.weight" for p in ATTN},
    **{f"layers.0.mlp.{p}.weight": f"midlayer.mlp.{p}.weight" for p in MLP},
    "layers.0.post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    "hidden_norm.weight": "midlayer.hidden_norm.weight",
    "input_embeds_norm.weight": "midlayer.input_layernorm.weight",
    "eagle_lm_head.weight": "lm_head.weight",
}
MODELOPT_ONLY = ("hidden_norm.weight", "input_embeds_norm.weight", "eagle_lm_head.weight")  # outside layers.0.*
SPECULATORS_LAYER = "layers.0."  # speculators / vLLM name the single EAGLE-3 decoder layer layers.0.*
SPECULATORS_MARKS = ("layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight")  # not in ModelOpt's layer 0
EAGLE3_LAYOUTS = (
    "original SafeAILab EAGLE-3 (midlayer.*, fc, norm, lm_head, d2t, t2d), "
    "ModelOpt ([eagle_module.]layers.0.*, hidden_norm, input_embeds_norm, eagle_lm_head), "
    'speculators (config.json speculators_model_type "eagle3", layers.0.* with layers.0.hidden_norm)'
)


def _speculators_config(cfg: dict, cfg_file: Path) -> dict | None:
    """The draft layer's config of a speculators-format head (None for other configs); refuses what it cannot build."""
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return None
    if kind != "eagle3":
        raise SpecbuildError(
            f"{cfg_file}: speculators_model_type {kind!r} is not an EAGLE-3 head; --eagle3-dir takes "
            f"speculators_model_type 'eagle3' (supported EAGLE-3 layouts: {EAGLE3_LAYOUTS})"
        )
    layer_cfg = cfg.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise SpecbuildError(
            f"{cfg_file}: speculators EAGLE-3 config needs transformer_layer_config (the draft layer's config) "
            f"as a mapping, got {layer_cfg!r}"
        )
    model_type = layer_cfg.get("model_type", "llama")
    if model_type != "llama":
        raise SpecbuildError(
            f"{cfg_file}: transformer_layer_config model_type {model_type!r} is not supported "
            "(speculators EAGLE-3 heads with a llama draft layer are)"
        )
    act = layer_cfg.get("hidden_act", "silu")
    if act != "silu":
        raise SpecbuildError(f"{cfg_file}: transformer_layer_config hidden_act {act!r} is not supported (silu is)")
    if cfg.get("norm_before_fc"):
        raise SpecbuildError(
            f"{cfg_file}: norm_before_fc true (an RMSNorm over the captured features before fc) is not supported"
        )
    return layer_cfg


def _eagle3_tensors(raw: dict[str, torch.Tensor], source: str, speculators: bool) -> tuple[HeadTensors, str]:
    """Canonical EAGLE-3 names from the SafeAILab, ModelOpt or speculators layout; returns (tensors, layout name).

    `speculators`: config.json says speculators_model_type eagle3 (its tensors may still use midlayer.* names,
    which vLLM maps to layers.0.* on load)."""
    if any(k.startswith(MODELOPT_PREFIX) for k in raw):  # a full ModelOpt model: keep only the draft module
        raw = {k[len(MODELOPT_PREFIX) :]: v for k, v in raw.items() if k.startswith(MODELOPT_PREFIX)}
        prefix = MODELOPT_PREFIX
    else:
        prefix = ""
    tensors, shown = strip_prefixes(raw, HEAD_PREFIXES, source)
    shown = {k: prefix + v for k, v in shown.items()}
    layer_ids = sorted({int(m[1]) for k in tensors if (m := LAYER_KEY.match(k))})
    if any(k.startswith("midlayer.") for k in tensors):
        if any(re.match(r"midlayer\.\d+\.", k) for k in tensors):
            raise SpecbuildError(f"{source}: multi-layer EAGLE-3 heads (midlayer.N.*) are not supported")
        return HeadTensors(tensors, shown, source), "speculators" if speculators else "original"
    named_speculators = not prefix and any(k in tensors for k in SPECULATORS_MARKS)
    if speculators or named_speculators:
        if layer_ids != [0]:
            found = f"layers.{layer_ids[-1]}.*" if layer_ids else "no layers.0.* tensors"
            if len(layer_ids) > 1:
                raise SpecbuildError(
                    f"{source}: multi-layer speculators EAGLE-3 heads ({found}) are not supported "
                    "(one draft layer, layers.0.*, is)"
                )
            raise SpecbuildError(
                f"{source}: speculators EAGLE-3 head (config.json speculators_model_type 'eagle3') holds "
                f"{found}; found tensors {sample_names(tensors)}; expected {SPECULATORS_LAYER}* "
                "(self_attn, mlp, hidden_norm, input_layernorm, post_attention_layernorm), fc, norm, lm_head"
            )
        renamed, renamed_shown = {}, {}
        for key, value in tensors.items():
            name = "midlayer." + key[len(SPECULATORS_LAYER) :] if key.startswith(SPECULATORS_LAYER) else key
            renamed[name], renamed_shown[name] = value, shown[key]
        for name in (*(f"self_attn.{p}.weight" for p in ATTN), *(f"mlp.{p}.weight" for p in MLP)):
            renamed_shown.setdefault("midlayer." + name, SPECULATORS_LAYER + name)  # missing: reported by file name
        for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            renamed_shown.setdefault(f"midlayer.{norm}.weight", f"{SPECULATORS_LAYER}{norm}.weight")
        return HeadTensors(renamed, renamed_shown, source), "speculators"
    if not prefix and not any(k in tensors for k in MODELOPT_ONLY):
        hint = "; layers.0.* without a hidden_norm looks like an EAGLE-1/2 head (--eagle-dir)" if layer_ids else ""
        raise SpecbuildError(
            f"{source}: no supported EAGLE-3 layout found (tensors: {sample_names(tensors)}){hint}; supported layouts: "
            f"{EAGLE3_LAYOUTS}"
        )
    multi = [i for i in layer_ids if i != 0]
    if multi:
        raise SpecbuildError(f"{source}: multi-layer ModelOpt EAGLE-3 heads (layers.{multi[0]}.*) are not supported")
    renamed, renamed_shown = {}, {}
    for key, value in tensors.items():
        name = MODELOPT_TO_EAGLE3.get(key, key)
        renamed[name], renamed_shown[name] = value, shown[key]
    for ours, theirs in MODELOPT_TO_EAGLE3.items():  # missing tensors are reported by their ModelOpt names
        renamed_shown.setdefault(theirs, prefix + ours)
    return HeadTensors(renamed, renamed_shown, source), "modelopt"


def _capture_layers(cfg: dict, num_layers: int, source: Path, speculators: bool = False) -> list[int]:
    """speculators: the head uses vLLM's names, so its ids use vLLM's indexing too (the input of layer i; i == L: the
    last layer's output); otherwise ModelOpt's (the output of layer i)."""
    if speculators:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids:
            bad = [int(i) for i in ids if not 0 <= int(i) <= num_layers]
            if bad or len(ids) != 3:
                why = (
                    f"names layer {bad[0]}, outside [0, {num_layers}] for the base model's {num_layers} layers"
                    if bad
                    else "must name 3 layers (fc takes 3 x target hidden size)"
                )
                raise SpecbuildError(f"{source}: eagle_aux_hidden_state_layer_ids {list(ids)} {why}")
            return [int(i) for i in ids]
    else:
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if aux:
            layers = [int(i) + 1 for i in aux]  # ModelOpt names the layer whose *output* is captured
            bad = [i - 1 for i in layers if not 1 <= i <= num_layers]
            if bad:
                raise SpecbuildError(
                    f"{source}: eagle_aux_hidden_state_layer_ids {list(aux)} names layer {bad[0]}, "
                    f"outside the base model's {num_layers} layers"
                )
            return layers
    wanted = [2, num_layers // 2, num_layers - 3]
    layers = [min(max(i, 0), num_layers - 1) for i in wanted]
    if layers != wanted:
        log.warning(
            "base model has only %d layers: EAGLE-3 capture layers %s clamped to %s", num_layers, wanted, layers
        )
    return layers


def _norm_before_residual(cfg: dict, cfg_file: Path, speculators: bool) -> bool:
    value = cfg.get("norm_before_residual")
    if value is None:
        if speculators:  # speculators' own class default is false, vLLM's speculators loader defaults to true
            log.warning("%s: speculators config without norm_before_residual: using vLLM's default (true)", cfg_file)
        return speculators
    if not isinstance(value, bool):
        raise SpecbuildError(f"{cfg_file}: norm_before_residual must be true or false, got {value!r}")
    return value


def convert_eagle3(head_dir: Path, model, base: dict, base_dir: Path | None = None) -> tuple[dict, dict]:
    """EAGLE-3 heads: SafeAILab `midlayer.*` checkpoints, ModelOpt exports (`eagle_module.` names) and speculators."""
    head_dir = Path(head_dir)
    raw, source, cfg = read_head(head_dir)
    cfg_file = head_dir / "config.json"
    layer_cfg = _speculators_config(cfg, cfg_file)
    spec_cfg = layer_cfg is not None
    src, layout = _eagle3_tensors(raw, source, speculators=spec_cfg)
    if layer_cfg is None:
        layer_cfg = cfg  # flat configs hold the draft layer's sizes at the top level
    vocab, base_h = model.vocab_size, model.hidden_size
    h = int(layer_cfg.get("hidden_size") or base_h)
    ht = int(cfg.get("target_hidden_size") or base_h)
    if ht != base_h:
        raise SpecbuildError(
            f"{head_dir / 'config.json'}: target_hidden_size {ht} differs from the base model's "
            f"hidden_size {base_h}: this head was trained for another model"
        )
    out: dict[str, torch.Tensor] = {}
    h_why = f"hidden_size {h}" + ("" if h == base_h else " of the draft config")
    out["fc.weight"] = src.take("fc.weight", (h, 3 * ht), f"{h_why}, 3 x target hidden size {ht}")
    dims = draft_dims(layer_cfg, model, h)
    q_out, kv_out = dims["num_heads"] * dims["head_dim"], dims["num_kv_heads"] * dims["head_dim"]
    inter = dims["intermediate_size"]
    attn_why = (
        f"num_attention_heads {dims['num_heads']}, num_key_value_heads {dims['num_kv_heads']}, "
        f"head_dim {dims['head_dim']}, input 2 x hidden_size {h}"
    )
    shapes = {"q_proj": (q_out, 2 * h), "k_proj": (kv_out, 2 * h), "v_proj": (kv_out, 2 * h), "o_proj": (h, q_out)}
    for proj, shape in shapes.items():
        key = f"midlayer.self_attn.{proj}.weight"
        out[key] = src.take(key, shape, attn_why)
    for proj, shape in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
        key = f"midlayer.mlp.{proj}.weight"
        out[key] = src.take(key, shape, f"intermediate_size {inter}, {h_why}")
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        out[f"midlayer.{norm}.weight"] = src.take(f"midlayer.{norm}.weight", (h,), h_why)
    out["norm.weight"] = src.take("norm.weight", (h,), h_why)

    d2t, t2d = src.take_index("d2t"), src.take_index("t2d")
    if src.has("lm_head.weight"):
        vd = int(src.tensors["lm_head.weight"].shape[0])
        out["lm_head.weight"] = src.take("lm_head.weight", (vd, h), h_why)
    elif layout == "modelopt" and h == base_h:  # ModelOpt drafts without eagle_lm_head use the base lm_head
        vd = vocab
        out["lm_head.weight"] = base_lm_head(base)
    else:
        vd = int(d2t.shape[0]) if d2t is not None and d2t.dim() == 1 else int(cfg.get("draft_vocab_size") or vocab)
        src.take("lm_head.weight", (vd, h), h_why)  # raises: missing
    if d2t is None:
        if vd != vocab:
            raise SpecbuildError(
                f"{source}: tensor {src.name('d2t')} is missing (expected shape {fmt_shape((vd,))}): "
                f"lm_head.weight has {vd} rows, a draft vocabulary smaller than the base's {vocab}"
            )
        if t2d is not None:
            raise SpecbuildError(f"{source}: tensor {src.name('t2d')} without d2t: the draft-to-target map is missing")
        d2t = torch.zeros(vocab, dtype=torch.int64)
    out["d2t"] = check_vocab_map(src, d2t, t2d, vd, vocab)

    embed_why = f"base vocab_size {vocab}, {h_why}"
    embed = src.take("embed_tokens.weight", (vocab, h), embed_why, optional=True)
    if embed is None and h != base_h:
        raise SpecbuildError(
            f"{source}: tensor embed_tokens.weight is missing (expected shape {fmt_shape((vocab, h))}): "
            f"the draft hidden_size {h} differs from the base's {base_h}, so the base embedding "
            "cannot be used"
        )
    if embed is not None and not same_tensor(embed, base.get(BASE_EMBED)):
        out["embed_tokens.weight"] = embed
    src.check_consumed(f"an EAGLE-3 head ({layout} layout)")

    head_cfg = {
        "version": 3,
        "hidden_size": h,
        "draft_vocab_size": vd,
        "target_hidden_size": ht,
        **{k: dims[k] for k in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size")},
        "rms_norm_eps": dims["rms_norm_eps"],
        "rope_theta": dims["rope_theta"],
        "rope_scaling": dims["rope_scaling"],
        "capture_layers": _capture_layers(cfg, model.num_layers, cfg_file, speculators=layout == "speculators"),
        "has_embed": "embed_tokens.weight" in out,
        "norm_before_residual": _norm_before_residual(cfg, cfg_file, spec_cfg),
        "layout": layout,
        "source": str(head_dir),
        "defaults": recorded_defaults(cfg, head_dir / "config.json"),
    }
    return head_cfg, out
