"""Random ReDrafter drafters written the way apple/ml-recurrent-drafter saves them (and TensorRT-LLM's variants)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def redrafter_state(
    hidden: int,
    vocab: int,
    exit_dim: int,
    layers: int = 2,
    rnn: bool = True,
    draft_vocab: list[int] | None = None,
    head_prefix: str = "lm_head.",
    proj_prefix: str = "input_proj.",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Weights large enough that the drafts depend on the context, the state and every block."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    if exit_dim != 2 * hidden:
        state[proj_prefix + "weight"] = torch.randn(exit_dim, 2 * hidden, generator=g) * 0.3
        state[proj_prefix + "bias"] = torch.randn(exit_dim, generator=g) * 0.1
    for i in range(layers):
        state[f"{head_prefix}{i}.linear.weight"] = torch.randn(exit_dim, exit_dim, generator=g) * 0.3
        state[f"{head_prefix}{i}.linear.bias"] = torch.randn(exit_dim, generator=g) * 0.1
    rows = len(draft_vocab) if draft_vocab is not None else vocab
    state[f"{head_prefix}{layers}.weight"] = torch.randn(rows, exit_dim, generator=g) * 0.5
    if rnn:
        state["rnn_u.weight"] = torch.randn(hidden, hidden, generator=g) * 0.3
        state["rnn_u.bias"] = torch.randn(hidden, generator=g) * 0.1
        state["rnn_w.weight"] = torch.randn(hidden, hidden, generator=g) * 0.3
    if draft_vocab is not None:
        state["draft_vocab"] = torch.tensor(draft_vocab, dtype=torch.int64)
    return state


def write_redrafter(
    out_dir: Path,
    hidden: int,
    vocab: int,
    exit_dim: int | None = None,
    layers: int = 2,
    rnn: bool = True,
    file: str = "model.safetensors",
    config: dict | None = None,
    state: dict | None = None,
    **kwargs,
) -> dict[str, torch.Tensor]:
    """config.json + weights in `file` (model.safetensors, model.pt or pytorch_model.bin); returns the state."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    exit_dim = 2 * hidden if exit_dim is None else exit_dim
    if state is None:
        state = redrafter_state(hidden, vocab, exit_dim, layers, rnn, **kwargs)
    cfg = {
        "model_type": "recurrent_drafting_drafter",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "exit_dim": exit_dim,
        "num_draft_layers": layers,
        "num_lookback_tokens": -1,
        "rnn": rnn,
        **(config or {}),
    }
    (out_dir / "config.json").write_text(json.dumps(cfg))
    if file.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / file))
    else:
        torch.save(state, out_dir / file)
    return state
