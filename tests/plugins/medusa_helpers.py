"""Make toy models and Medusa heads in every published format for the Medusa tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.shapes import tiny_hf_model

TOY_VOCAB = 12


def toy_model(shape: str, out_dir: Path, vocab: int = TOY_VOCAB, seed: int = 0):
    model = tiny_hf_model(shape, seed=seed, vocab_size=vocab, eos_token_id=None)
    model.save_pretrained(out_dir)
    return model


def medusa_state(hidden: int, vocab: int, num_heads: int, own_lm_head: bool, layers: int = 1, seed: int = 0):
    """Random heads (not near-identity, so drafts differ from the base prediction) with published key names."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for h in range(num_heads):
        for j in range(layers):
            state[f"{h}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.4
            state[f"{h}.{j}.linear.bias"] = torch.randn(hidden, generator=g) * 0.1
        if own_lm_head:
            state[f"{h}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g) * 0.5
    return state


def write_medusa_heads(
    out_dir: Path,
    fmt: str,
    hidden: int,
    vocab: int,
    num_heads: int = 3,
    layers: int = 1,
    config: dict | None = None,
    base_dir: Path | None = None,
    seed: int = 0,
) -> dict:
    """fmt: v0.1-pt | legacy-safetensors | v2 | medusa2-full. Returns the state written (published names)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {"medusa_num_heads": num_heads, "medusa_num_layers": layers, "base_model_name_or_path": "toy"}
    if fmt == "v2":
        cfg["version"] = "2"
    cfg.update(config or {})
    state = medusa_state(hidden, vocab, num_heads, own_lm_head=fmt != "v2", layers=layers, seed=seed)
    if fmt == "v0.1-pt":
        torch.save(state, out_dir / "medusa_lm_head.pt")
    elif fmt in ("legacy-safetensors", "v2"):
        save_file(state, str(out_dir / "medusa_lm_head.safetensors"))
    elif fmt == "medusa2-full":
        from safetensors.torch import load_file

        base = load_file(str(Path(base_dir) / "model.safetensors"))
        base.update({f"medusa_head.{k}": v for k, v in state.items()})
        save_file(base, str(out_dir / "model.safetensors"))
        base_cfg = json.loads((Path(base_dir) / "config.json").read_text())
        cfg = {**base_cfg, **cfg}
    else:
        raise ValueError(fmt)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return state
