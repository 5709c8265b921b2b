"""`specbuild convert --redrafter-dir DIR`: apple/ml-recurrent-drafter checkpoints -> canonical drafter tensors.

Accepted: `config.json` (`model_type: recurrent_drafting_drafter`, `vocab_size`, `hidden_size`, `exit_dim`,
`num_draft_layers`, `rnn`) with `model.safetensors`, `model.pt` or `pytorch_model.bin` (loaded weights_only), under
the names Apple's `Drafter` saves (`lm_head.{i}.linear.*` ResBlocks, `lm_head.{n}.weight` vocabulary projection,
`input_proj.*`, `rnn_u.*`, `rnn_w.weight`) or the variants TensorRT-LLM reads (`lm_heads.*` or a bare `0.*` for the
head, `input_projs.*`). Everything is checked against the tensors themselves: `input_proj` exists exactly when
`exit_dim != 2 * hidden_size`, the ResBlocks number `num_draft_layers`, `rnn_u`/`rnn_w` exist exactly when `rnn` is
true, vocabulary and hidden size equal the base model's. specbuild extension: a `draft_vocab` tensor (strictly
increasing token ids) restricts the vocabulary projection to those rows (`lm_head.{n}.weight [len(draft_vocab), E]`).

Canonical tensors: `input_proj.{weight,bias}` (optional), `blocks.{i}.{weight,bias}`, `lm_head.weight`,
`rnn_u.{weight,bias}` + `rnn_w.weight` (optional), `draft_vocab` (optional).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from specbuild.builder.checkpoint.canonical import read_json, recorded_defaults
from specbuild.builder.checkpoint.weights_io import load_tensor_file
from specbuild.errors import SpecbuildError

MODEL_TYPE = "recurrent_drafting_drafter"
WEIGHT_FILES = ("model.safetensors", "model.pt", "pytorch_model.bin")
HEAD_PREFIXES = ("lm_head.", "lm_heads.", "0.")  # Apple's nn.Sequential, and TensorRT-LLM's accepted spellings
PROJ_PREFIXES = ("input_proj.", "input_projs.")
HEAD_KEY = re.compile(r"^(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _read_config(head_dir: Path) -> dict:
    file = head_dir / "config.json"
    if not file.is_file():
        raise SpecbuildError(f"{file}: missing (a ReDrafter directory holds config.json and its weights)")
    cfg = read_json(file)
    model_type = cfg.get("model_type")
    if model_type is not None and model_type != MODEL_TYPE:
        raise SpecbuildError(f"{file}: model_type {model_type!r} is not a ReDrafter drafter ({MODEL_TYPE!r})")
    for key in ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "num_draft_layers" else 1):
            raise SpecbuildError(f"{file}: {key} must be a positive integer, got {value!r}")
    if not isinstance(cfg.get("rnn", False), bool):
        raise SpecbuildError(f"{file}: rnn must be true or false, got {cfg.get('rnn')!r}")
    return cfg


def _read_weights(head_dir: Path) -> tuple[dict, str]:
    for name in WEIGHT_FILES:
        if (head_dir / name).is_file():
            return load_tensor_file(head_dir / name), str(head_dir / name)
    raise SpecbuildError(f"{head_dir}: no drafter weights (expected one of {', '.join(WEIGHT_FILES)})")


def _strip(raw: dict, source: str) -> dict[str, torch.Tensor]:
    """Published names -> canonical ones; an unknown tensor is an error naming it."""
    out: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        name = key.removeprefix("drafter.")
        head = next((name[len(p) :] for p in HEAD_PREFIXES if name.startswith(p)), None)
        proj = next((name[len(p) :] for p in PROJ_PREFIXES if name.startswith(p)), None)
        m = HEAD_KEY.match(head) if head is not None else None
        if m:
            canonical = f"head.{m[1]}.{m[2]}"
        elif proj in ("weight", "bias"):
            canonical = f"input_proj.{proj}"
        elif name in ("rnn_u.weight", "rnn_u.bias", "rnn_w.weight", "draft_vocab"):
            canonical = name
        else:
            raise SpecbuildError(f"{source}: unexpected tensor {key} in a ReDrafter checkpoint")
        if canonical in out:
            raise SpecbuildError(f"{source}: tensor {key} is stored twice under different spellings")
        out[canonical] = value
    return out


def _expect(tensors: dict, name: str, shape: tuple, source: str, published: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise SpecbuildError(f"{source}: tensor {published} is missing (expected shape {list(shape)})")
    if tuple(t.shape) != tuple(shape):
        raise SpecbuildError(f"{source}: tensor {published} has shape {list(t.shape)}, expected {list(shape)}")
    if not t.is_floating_point():
        raise SpecbuildError(f"{source}: tensor {published} has dtype {t.dtype}, expected a floating-point type")
    return t


def convert_redrafter(head_dir: Path, model, base: dict, base_dir: Path | None = None) -> tuple[dict, dict]:
    head_dir = Path(head_dir)
    cfg = _read_config(head_dir)
    config_file = head_dir / "config.json"
    h, v = model.hidden_size, model.vocab_size
    if cfg["hidden_size"] != h:
        raise SpecbuildError(f"{config_file}: hidden_size {cfg['hidden_size']} differs from the base model's {h}")
    if cfg["vocab_size"] != v:
        raise SpecbuildError(f"{config_file}: vocab_size {cfg['vocab_size']} differs from the base model's {v}")
    raw, source = _read_weights(head_dir)
    tensors = _strip(raw, source)
    e, n, rnn = cfg["exit_dim"], cfg["num_draft_layers"], bool(cfg.get("rnn", False))
    out: dict[str, torch.Tensor] = {}
    if e != 2 * h:
        out["input_proj.weight"] = _expect(tensors, "input_proj.weight", (e, 2 * h), source, "input_proj.weight")
        out["input_proj.bias"] = _expect(tensors, "input_proj.bias", (e,), source, "input_proj.bias")
    elif "input_proj.weight" in tensors or "input_proj.bias" in tensors:
        raise SpecbuildError(
            f"{source}: holds input_proj but exit_dim {e} == 2 * hidden_size ({2 * h}) means the drafter has none "
            f"(config.json {config_file} and the tensors disagree)"
        )
    blocks = sorted(int(k.split(".")[1]) for k in tensors if k.startswith("head.") and k.endswith("linear.weight"))
    if blocks != list(range(n)):
        missing = [i for i in range(n) if i not in blocks]
        what = f"ResBlock lm_head.{missing[0]}.linear.weight is missing" if missing else f"found ResBlocks {blocks}"
        raise SpecbuildError(f"{source}: num_draft_layers is {n} but {what} (expected shape {[e, e]})")
    for i in range(n):
        out[f"blocks.{i}.weight"] = _expect(
            tensors, f"head.{i}.linear.weight", (e, e), source, f"lm_head.{i}.linear.weight"
        )
        out[f"blocks.{i}.bias"] = _expect(tensors, f"head.{i}.linear.bias", (e,), source, f"lm_head.{i}.linear.bias")
    draft_vocab = tensors.get("draft_vocab")
    rows = v
    if draft_vocab is not None:
        ids = draft_vocab.to(torch.int64).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= v or not bool((ids[1:] > ids[:-1]).all()):
            raise SpecbuildError(f"{source}: draft_vocab must hold strictly increasing token ids in [0, {v})")
        out["draft_vocab"] = ids
        rows = int(ids.numel())
    out["lm_head.weight"] = _expect(tensors, f"head.{n}.weight", (rows, e), source, f"lm_head.{n}.weight")
    extra = sorted(k for k in tensors if k.startswith("head.") and int(k.split(".")[1]) > n)
    if extra:
        raise SpecbuildError(f"{source}: tensor lm_head.{extra[0][5:]} lies beyond num_draft_layers {n} + 1 layers")
    has_rnn = any(k.startswith(("rnn_u.", "rnn_w.")) for k in tensors)
    if rnn:
        out["rnn_u.weight"] = _expect(tensors, "rnn_u.weight", (h, h), source, "rnn_u.weight")
        out["rnn_u.bias"] = _expect(tensors, "rnn_u.bias", (h,), source, "rnn_u.bias")
        out["rnn_w.weight"] = _expect(tensors, "rnn_w.weight", (h, h), source, "rnn_w.weight")
    elif has_rnn:
        raise SpecbuildError(f"{source}: holds rnn_u/rnn_w tensors but config.json {config_file} says rnn is false")
    head_cfg = {
        "format": "apple-redrafter",
        "num_layers": n,
        "exit_dim": e,
        "rnn": rnn,
        "draft_vocab_size": rows if draft_vocab is not None else None,
        "source": str(head_dir),
    }
    head_cfg["defaults"] = recorded_defaults(cfg, config_file)  # build defaults the drafter was tuned for
    return head_cfg, out
