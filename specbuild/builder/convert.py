"""`specbuild convert`: a Hugging Face model directory (+ speculative heads) -> one validated canonical checkpoint.

Validation works from the tensors themselves: every expected tensor present, nothing unexpected, shapes matching
config.json, floating-point dtypes. The output directory is written atomically: a failure leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from specbuild.builder.checkpoint import DTYPES, read_json, write_checkpoint
from specbuild.builder.model_config import ModelConfig
from specbuild.builder.tokenizer_io import carry_tokenizer, read_chat_template
from specbuild.builder.weights_io import load_hf_weights
from specbuild.errors import SpecbuildError
from specbuild.fsutil import atomic_output_dir

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Medusa-2 full models keep their heads beside the base weights; `--medusa-dir` on the same directory reads them.
IGNORED_PREFIXES = ("medusa_head.",)
LM_HEAD = "lm_head.weight"
MAX_LISTED = 5  # tensors named per error message


def convert_checkpoint(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    dtype: str = "float32",
    heads: dict[str, Path] | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the HF model in `model_dir` (and each head directory in `heads`, mode -> dir) into `output_dir`."""
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if dtype not in TORCH_DTYPES:
        raise SpecbuildError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not model_dir.is_dir():
        raise SpecbuildError(f"{model_dir}: model directory does not exist")
    _check_not_overlapping(model_dir, output_dir)
    for name, head_dir in (heads or {}).items():
        if not Path(head_dir).is_dir():
            raise SpecbuildError(f"{head_dir}: {name} head directory does not exist")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise SpecbuildError(f"{config_file}: missing (a Hugging Face model directory needs config.json)")
    model = ModelConfig.from_hf(read_json(config_file), source=str(config_file))
    _add_generation_eos(model, model_dir)

    with atomic_output_dir(output_dir, overwrite=overwrite) as tmp:
        raw = load_hf_weights(model_dir, progress=progress)
        tensors = validate_base_tensors(model, raw, source=str(model_dir))
        tensors = {k: v.to(TORCH_DTYPES[dtype]) for k, v in tensors.items()}
        head_out = _convert_heads(heads or {}, model, tensors, TORCH_DTYPES[dtype])
        write_checkpoint(
            tmp,
            model,
            tensors,
            dtype,
            heads=head_out,
            chat_template=read_chat_template(model_dir),
            source=str(model_dir.resolve()),
        )
        if not carry_tokenizer(model_dir, tmp):
            log.warning("%s: no tokenizer (tokenizer.json or tokenizer.model); the checkpoint has none", model_dir)
    return output_dir


def validate_base_tensors(model: ModelConfig, raw: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The base-model tensors of `raw` checked against `model`: ignorable tensors dropped, errors name the tensor."""
    tensors = {k: v for k, v in raw.items() if not k.endswith(IGNORED_SUFFIXES) and not k.startswith(IGNORED_PREFIXES)}
    if model.tie_word_embeddings:
        tensors.pop(LM_HEAD, None)
    expected = model.expected_shapes()
    if LM_HEAD in expected and LM_HEAD not in tensors:
        raise SpecbuildError(
            f"{source}: tensor {LM_HEAD} is missing (expected shape {_fmt(expected[LM_HEAD])}) and config.json has "
            "tie_word_embeddings false; set tie_word_embeddings true if the output projection shares the embedding"
        )
    missing = [k for k in expected if k not in tensors]
    if missing:
        listed = ", ".join(f"{k} (expected shape {_fmt(expected[k])})" for k in missing[:MAX_LISTED])
        raise SpecbuildError(f"{source}: {_count(missing, 'missing tensor')}: {listed}{_more(missing)}")
    extra = [k for k in tensors if k not in expected]
    if extra:
        listed = ", ".join(f"{k} (shape {_fmt(tensors[k].shape)})" for k in extra[:MAX_LISTED])
        raise SpecbuildError(
            f"{source}: {_count(extra, 'unexpected tensor')} for a {model.architecture} model with "
            f"{model.num_layers} layers: {listed}{_more(extra)}"
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise SpecbuildError(
                f"{source}: tensor {name} has shape {_fmt(got)}, expected {_fmt(shape)} from config.json"
            )
        if not tensors[name].is_floating_point():
            raise SpecbuildError(
                f"{source}: tensor {name} has dtype {str(tensors[name].dtype).removeprefix('torch.')}, "
                "expected a floating-point dtype (quantized checkpoints are not supported)"
            )
    return {name: tensors[name] for name in expected}


def _convert_heads(
    heads: dict[str, Path], model: ModelConfig, base: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, tuple[dict, dict]]:
    from specbuild.plugins.registry import head_converter

    out = {}
    for name, head_dir in heads.items():
        head_cfg, head_tensors = head_converter(name)(Path(head_dir), model, base)
        out[name] = (head_cfg, {k: v.to(dtype) if v.is_floating_point() else v for k, v in head_tensors.items()})
    return out


def _add_generation_eos(model: ModelConfig, model_dir: Path) -> None:
    """Add generation_config.json's EOS ids (what transformers' generate stops on) to the model's."""
    gen_file = model_dir / "generation_config.json"
    if not gen_file.is_file():
        return
    eos = read_json(gen_file).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    for token in ids:
        if int(token) not in model.eos_token_ids:
            model.eos_token_ids.append(int(token))


def _check_not_overlapping(model_dir: Path, output_dir: Path) -> None:
    src, dst = model_dir.resolve(), output_dir.resolve()
    if src == dst or dst in src.parents:
        raise SpecbuildError(
            f"output directory {output_dir} would replace the model directory {model_dir}; choose another"
        )


def _fmt(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def _count(names: list[str], what: str) -> str:
    return f"{len(names)} {what}{'s' if len(names) > 1 else ''}"


def _more(names: list[str]) -> str:
    return f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
