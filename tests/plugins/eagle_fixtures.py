"""Write random EAGLE-1/2 and EAGLE-3 heads in their published layouts for a tiny base model config.

`base_cfg` is a transformers config (tests.shapes.tiny_hf_config) or a plain dict with the same keys. Weights are
random with std 0.3 and norm weights around 1, so every tensor matters. Each writer returns the state dict it wrote,
under the names it used in the file (prefixes included).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

STD = 0.3
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _get(cfg, key, default=None):
    value = cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)
    return default if value is None else value


def base_dims(base_cfg) -> dict:
    """hidden, vocab, heads, kv_heads, head_dim, intermediate of a base config."""
    hidden, heads = int(_get(base_cfg, "hidden_size")), int(_get(base_cfg, "num_attention_heads"))
    return {
        "hidden": hidden,
        "vocab": int(_get(base_cfg, "vocab_size")),
        "heads": heads,
        "kv_heads": int(_get(base_cfg, "num_key_value_heads", heads)),
        "head_dim": int(_get(base_cfg, "head_dim", hidden // heads)),
        "intermediate": int(_get(base_cfg, "intermediate_size")),
    }


def _draft_config(base_cfg, **extra) -> dict:
    cfg = base_cfg if isinstance(base_cfg, dict) else base_cfg.to_dict()
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "vocab_size",
        "max_position_embeddings",
    )
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float16"}
    out.update({k: cfg[k] for k in keys if cfg.get(k) is not None})
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def save_state(state: dict, out_dir: Path, fmt: str) -> None:
    state = {k: v.contiguous() for k, v in state.items()}
    if fmt == "bin":
        torch.save(state, out_dir / "pytorch_model.bin")
    elif fmt == "safetensors":
        save_file(state, str(out_dir / "model.safetensors"))
    elif fmt == "sharded":
        names = sorted(state)
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        for file, keys in shards.items():
            save_file({k: state[k] for k in keys}, str(out_dir / file))
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        raise ValueError(fmt)


def _layer(g, d: dict, in_dim: int, prefix: str, qkv_bias: bool = False) -> dict:
    h, q_out, kv_out, inter = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"], d["intermediate"]
    shapes = {"q_proj": (q_out, in_dim), "k_proj": (kv_out, in_dim), "v_proj": (kv_out, in_dim), "o_proj": (h, q_out)}
    state = {f"{prefix}self_attn.{p}.weight": STD * torch.randn(s, generator=g) for p, s in shapes.items()}
    if qkv_bias:
        for p in ("q_proj", "k_proj", "v_proj"):
            state[f"{prefix}self_attn.{p}.bias"] = 0.2 * torch.randn(shapes[p][0], generator=g)
    for p, s in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
        state[f"{prefix}mlp.{p}.weight"] = STD * torch.randn(s, generator=g)
    state[f"{prefix}post_attention_layernorm.weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    return state


def reduced_vocab(vocab: int, draft_vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A valid (d2t [Vd] int64, t2d [V] bool) pair: Vd sorted random target ids, d2t[i] = id_i - i."""
    g = torch.Generator().manual_seed(seed + 1000)
    used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab), t2d


def write_eagle1_head(
    out_dir: Path,
    base_cfg,
    *,
    fmt: str = "bin",
    fc_bias: bool = True,
    with_embed: bool = False,
    embed: torch.Tensor | None = None,
    num_layers: int = 1,
    config_layers: int | None = None,
    qkv_bias: bool = False,
    prefix: str = "",
    draft_vocab: int | None = None,
    config_extra: dict | None = None,
    seed: int = 0,
) -> dict:
    """An EAGLE-1/2 head (SafeAILab `ea_layer` names, optional `prefix` such as "ea_layer.").

    fmt: bin | safetensors | sharded. with_embed writes a random embed_tokens (or `embed` if given).
    config_layers: num_hidden_layers written to config.json (default num_layers; the classic fault disagrees).
    draft_vocab: also write the specbuild extension `lm_head.weight [Vd,H]` + `d2t [Vd]`.
    config_extra: keys merged into config.json (None values delete keys); `bias` defaults to fc_bias.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = base_dims(base_cfg)
    # offset seed: tests.shapes' tiny models draw their embedding first from manual_seed(seed)
    h, g = d["hidden"], torch.Generator().manual_seed(seed + 7919)
    state = {}
    if with_embed or embed is not None:
        state["embed_tokens.weight"] = (
            embed.clone() if embed is not None else 0.5 * torch.randn(d["vocab"], h, generator=g)
        )
    state["fc.weight"] = STD * torch.randn(h, 2 * h, generator=g)
    if fc_bias:
        state["fc.bias"] = 0.2 * torch.randn(h, generator=g)
    for i in range(num_layers):
        state.update(_layer(g, d, h, f"layers.{i}.", qkv_bias=qkv_bias))
        if i > 0:
            state[f"layers.{i}.input_layernorm.weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    if draft_vocab is not None:
        state["lm_head.weight"] = 0.5 * torch.randn(draft_vocab, h, generator=g)
        state["d2t"], _ = reduced_vocab(d["vocab"], draft_vocab, seed)
    state = {prefix + k: v for k, v in state.items()}
    save_state(state, out_dir, fmt)
    extra = {"num_hidden_layers": config_layers or num_layers, "bias": fc_bias, **(config_extra or {})}
    if qkv_bias:
        extra.setdefault("qkv_bias", True)
    (out_dir / "config.json").write_text(json.dumps(_draft_config(base_cfg, **extra)))
    return state


def eagle3_state(base_cfg, *, draft_vocab: int | None = None, with_t2d: bool = True, seed: int = 0) -> dict:
    """The 15 published EAGLE-3 tensors (SafeAILab names): no embed_tokens, reduced vocab when draft_vocab < V."""
    d = base_dims(base_cfg)
    h, vocab, g = d["hidden"], d["vocab"], torch.Generator().manual_seed(seed + 7919)
    vd = vocab if draft_vocab is None else draft_vocab
    state = {"fc.weight": STD * torch.randn(h, 3 * h, generator=g)}
    state.update(_layer(g, d, 2 * h, "midlayer."))
    for norm in ("hidden_norm", "input_layernorm"):
        state[f"midlayer.{norm}.weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    state["norm.weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    state["lm_head.weight"] = 0.5 * torch.randn(vd, h, generator=g)
    if vd != vocab:
        state["d2t"], t2d = reduced_vocab(vocab, vd, seed)
        if with_t2d:
            state["t2d"] = t2d
    return state


# SafeAILab EAGLE-3 name -> ModelOpt eagle_module name
EAGLE3_TO_MODELOPT = {
    **{f"midlayer.self_attn.{p}.weight": f"layers.0.self_attn.{p}.weight" for p in ATTN},
    **{f"midlayer.mlp.{p}.weight": f"layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    "midlayer.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.input_layernorm.weight": "input_embeds_norm.weight",
    "lm_head.weight": "eagle_lm_head.weight",
}


def speculators_config(base_cfg, *, draft_vocab: int, norm_before_residual: bool | None = False, **top) -> dict:
    """config.json of a speculators (vLLM) EAGLE-3 head: the draft layer's LlamaConfig under transformer_layer_config
    (vocab_size = the target's), EAGLE-3 fields at the top level. norm_before_residual None leaves the key out."""
    layer = _draft_config(base_cfg, num_hidden_layers=1, architectures=None, torch_dtype=None)
    layer.update({"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False})
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "org/verifier"},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": None,
        "embed_requires_grad": False,
        "torch_dtype": "bfloat16",
        **top,
    }
    if norm_before_residual is None:
        del cfg["norm_before_residual"]
    return cfg


def write_eagle3_head(
    out_dir: Path,
    base_cfg,
    *,
    layout: str = "original",
    fmt: str = "bin",
    draft_vocab: int | None = None,
    with_t2d: bool = True,
    config_extra: dict | None = None,
    norm_before_residual: bool | None = False,
    embed: torch.Tensor | None = None,
    seed: int = 0,
) -> dict:
    """An EAGLE-3 head. layout: original (SafeAILab `midlayer.*`) | modelopt (`eagle_module.layers.0.*` etc.) |
    speculators (vLLM's speculators format: `layers.0.*`, d2t and t2d always, speculators config.json).

    draft_vocab: size of the reduced draft vocabulary (default: the base vocab, no d2t/t2d except for speculators).
    The original/modelopt config keeps num_hidden_layers 40 like the official Vicuna-13B EAGLE-3 config.
    norm_before_residual (speculators only; None leaves the key out), embed (written as embed_tokens.weight, as
    speculators does with the verifier's embedding). Returns the state under the written names.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = eagle3_state(base_cfg, draft_vocab=draft_vocab, with_t2d=with_t2d, seed=seed)
    vocab = base_dims(base_cfg)["vocab"]
    if embed is not None:
        state["embed_tokens.weight"] = embed.clone()
    if layout == "speculators":
        vd = draft_vocab or vocab
        if "d2t" not in state:
            state["d2t"] = torch.zeros(vd, dtype=torch.int64)
            state["t2d"] = torch.ones(vocab, dtype=torch.bool)
        state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
        save_state(state, out_dir, fmt)
        cfg = speculators_config(base_cfg, draft_vocab=vd, norm_before_residual=norm_before_residual)
        cfg.update(config_extra or {})
        (out_dir / "config.json").write_text(json.dumps(cfg))
        return state
    extra = {
        "num_hidden_layers": 40,
        "draft_vocab_size": draft_vocab or vocab,
        "architectures": ["LlamaForCausalLMEagle3"],
    }
    if layout == "modelopt":
        state = {"eagle_module." + EAGLE3_TO_MODELOPT.get(k, k): v for k, v in state.items() if k != "t2d"}
        extra["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": None}
    elif layout != "original":
        raise ValueError(layout)
    extra.update(config_extra or {})
    save_state(state, out_dir, fmt)
    (out_dir / "config.json").write_text(json.dumps(_draft_config(base_cfg, **extra)))
    return state


def toy_eagle3_checkpoint(root: Path, seed: int) -> Path:
    """A canonical checkpoint of a 12-token GQA toy (llama3 RoPE) with an EAGLE-3 head of an 8-token draft vocabulary,
    under `root`."""
    from specbuild.builder.checkpoint.convert import convert_checkpoint
    from tests.plugins.medusa_helpers import toy_model

    model = toy_model("llama_gqa_llama3rope", root / "hf", vocab=12, seed=seed)
    write_eagle3_head(root / "eagle3", model.config, draft_vocab=8, seed=seed)
    return convert_checkpoint(root / "hf", root / "ckpt", heads={"eagle3": root / "eagle3"}, progress=False)
