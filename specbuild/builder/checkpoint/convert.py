"""`specbuild convert`: a Hugging Face model directory (+ speculative heads) -> one validated canonical checkpoint.

Validation works from the tensors themselves: every expected tensor present, nothing unexpected, shapes matching
config.json, floating-point dtypes. The output directory is written atomically: a failure leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.canonical import DTYPES, read_json, write_checkpoint
from specbuild.builder.checkpoint.fused_tensors import unfuse
from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.checkpoint.tokenizer_io import (
    SENTENCEPIECE_FILE,
    carry_tokenizer,
    chat_template_source,
    read_chat_template,
    validate_tokenizer,
)
from specbuild.builder.checkpoint.torch_dtypes import FLOAT_DTYPES
from specbuild.builder.checkpoint.weights_io import LazyTensors, open_hf_weights, spec_of
from specbuild.errors import SpecbuildError
from specbuild.fsutil import atomic_output_dir, prepare_output_dir

log = logging.getLogger(__name__)

AUTO = "auto"  # --dtype: the base weights' own dtype
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Medusa-2 full models keep their heads beside the base weights; `--medusa-dir` on the same directory reads them.
IGNORED_PREFIXES = ("medusa_head.",)
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_LISTED = 5  # tensors named per error message


def convert_checkpoint(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    dtype: str = AUTO,
    heads: dict[str, Path] | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the HF model in `model_dir` (and each head directory in `heads`, mode -> dir) into `output_dir`."""
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if dtype != AUTO and dtype not in FLOAT_DTYPES:
        raise SpecbuildError(f"unsupported dtype {dtype!r}; choose one of {AUTO}, {', '.join(DTYPES)}")
    if not model_dir.is_dir():
        raise SpecbuildError(f"{model_dir}: model directory does not exist")
    for name, head_dir in (heads or {}).items():
        if not Path(head_dir).is_dir():
            raise SpecbuildError(f"{head_dir}: {name} head directory does not exist")
    target = prepare_output_dir(output_dir, overwrite=overwrite, inputs=[model_dir, *(heads or {}).values()])
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise SpecbuildError(f"{config_file}: missing (a Hugging Face model directory needs config.json)")
    model = ModelConfig.from_hf(read_json(config_file), source=str(config_file))
    _add_generation_eos(model, model_dir)

    with atomic_output_dir(target) as tmp:
        chat_template = read_chat_template(model_dir)  # the cheap inputs first: they fail before the weights load
        if carry_tokenizer(model_dir, tmp):
            source = model_dir / ef.TOKENIZER_FILE
            source = source if source.is_file() else model_dir / SENTENCEPIECE_FILE
            template_source = chat_template_source(model_dir)
            validate_tokenizer(tmp / ef.TOKENIZER_FILE, source, model.vocab_size, chat_template, template_source)
        else:
            log.warning("%s: no tokenizer (tokenizer.json or tokenizer.model); the checkpoint has none", model_dir)
        raw = unfuse(model, open_hf_weights(model_dir), str(model_dir))
        names = validate_base_tensors(model, raw, source=str(model_dir))
        dtype = checkpoint_dtype(dtype, raw, names)
        out_dtype = FLOAT_DTYPES[dtype]
        tensors = raw.subset(names).cast(
            lambda name: out_dtype if raw.specs[name][1].is_floating_point else raw.specs[name][1],
            lambda tensor, name: _cast(tensor, out_dtype, name, model_dir),
        )
        head_out = _convert_heads(heads or {}, model, tensors, out_dtype, model_dir)
        write_checkpoint(
            tmp,
            model,
            tensors,
            dtype,
            heads=head_out,
            chat_template=chat_template,
            source=str(model_dir.resolve()),
            progress=progress,
        )
    return output_dir


def checkpoint_dtype(requested: str, tensors: LazyTensors, names: list[str]) -> str:
    """--dtype, or with `auto` the base weights' own floating-point dtype when they share one (float32 otherwise)."""
    if requested != AUTO:
        return requested
    found = {tensors.specs[name][1] for name in names} - {torch.float64}
    by_torch = {v: k for k, v in FLOAT_DTYPES.items()}
    return by_torch[found.pop()] if len(found) == 1 and next(iter(found)) in by_torch else "float32"


def validate_base_tensors(model: ModelConfig, raw: Mapping[str, torch.Tensor], source: str) -> list[str]:
    """The names of the base-model tensors of `raw` (lazy or not), checked against `model` from their shapes and
    dtypes: ignorable tensors dropped, a tied lm_head equal to the embedding dropped, errors name the tensor."""
    tensors = [k for k in raw if not k.endswith(IGNORED_SUFFIXES) and not k.startswith(IGNORED_PREFIXES)]
    if model.tie_word_embeddings and LM_HEAD in tensors:
        if EMBED in tensors and not _same_tensor(raw[LM_HEAD], raw[EMBED]):
            # transformers 4.x ties them (the file's lm_head is ignored), 5.x keeps the file's lm_head untied:
            # the output would depend on the transformers version, so neither reading is guessed
            raise SpecbuildError(
                f"{source}: config.json has tie_word_embeddings true but tensor {LM_HEAD} differs from {EMBED}; "
                "set tie_word_embeddings false to use lm_head.weight, or delete lm_head.weight to tie it to the "
                "embedding"
            )
        tensors.remove(LM_HEAD)
    specs = {name: spec_of(raw, name) for name in tensors}
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
        listed = ", ".join(f"{k} (shape {_fmt(specs[k][0])})" for k in extra[:MAX_LISTED])
        raise SpecbuildError(
            f"{source}: {_count(extra, 'unexpected tensor')} for a {model.architecture} model with "
            f"{model.num_layers} layers: {listed}{_more(extra)}"
        )
    for name, shape in expected.items():
        got, dtype = specs[name]
        if got != shape:
            raise SpecbuildError(
                f"{source}: tensor {name} has shape {_fmt(got)}, expected {_fmt(shape)} from config.json"
            )
        if dtype not in WEIGHT_DTYPES:
            raise SpecbuildError(
                f"{source}: tensor {name} has dtype {str(dtype).removeprefix('torch.')}, expected "
                "float32, float16, bfloat16 or float64 (quantized checkpoints are not supported)"
            )
    return list(expected)


def _convert_heads(
    heads: dict[str, Path], model: ModelConfig, base: Mapping[str, torch.Tensor], dtype: torch.dtype, model_dir: Path
) -> dict[str, tuple[dict, dict]]:
    """Each mode's converter reads its head directory against the base model's config, tensors and directory (its
    tokenizer, for a draft model)."""
    from specbuild.modes.registry import head_converter

    out = {}
    for name, head_dir in heads.items():
        head_cfg, head_tensors = head_converter(name)(Path(head_dir), model, base, base_dir=model_dir)
        out[name] = (head_cfg, {k: _cast(v, dtype, k, head_dir) for k, v in head_tensors.items()})
    return out


def _cast(tensor: torch.Tensor, dtype: torch.dtype, name: str, source) -> torch.Tensor:
    """`tensor` in `dtype` (floating point only); values the target dtype cannot hold are an error, never Inf."""
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    cast = tensor.to(dtype)
    if dtype == torch.float16 and not bool(torch.isfinite(cast).all()):
        raise SpecbuildError(
            f"{source}: tensor {name} holds values beyond float16's range (|x| > 65504); "
            "convert with --dtype bfloat16 or float32"
        )
    return cast


def _add_generation_eos(model: ModelConfig, model_dir: Path) -> None:
    """Add generation_config.json's EOS ids (what transformers' generate stops on) to the model's."""
    gen_file = model_dir / "generation_config.json"
    if not gen_file.is_file():
        return
    eos = read_json(gen_file).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise SpecbuildError(f"{gen_file}: eos_token_id {eos!r} is not a token id or a list of token ids")
    for token in ids:
        if int(token) not in model.eos_token_ids:
            model.eos_token_ids.append(int(token))


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b.to(a.dtype))


def _fmt(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def _count(names: list[str], what: str) -> str:
    return f"{len(names)} {what}{'s' if len(names) > 1 else ''}"


def _more(names: list[str]) -> str:
    return f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
