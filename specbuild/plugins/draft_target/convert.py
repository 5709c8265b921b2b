"""`specbuild convert --draft-model-dir DIR`: a draft model read and checked like any checkpoint, and checked to share
the target's tokenizer (same vocabulary size, same id for every token string, same special tokens, same BOS/EOS).

The draft goes into the checkpoint as heads/draft-target.safetensors (its Llama tensors, HF names) with its model
config under config.yaml `heads.draft-target.model`. A draft whose config.json says {"specbuild": {"embeddings":
"target"}} ships without model.embed_tokens.weight and takes the target's (the shipped SmolLM2 draft, to stay small).
An optional draft_vocab.json beside it lists token ids most frequent first: the build may project the draft onto
the first N of them (--draft-vocab-size).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specbuild import engine_format as ef
from specbuild.builder.checkpoint.canonical import read_json
from specbuild.builder.checkpoint.convert import EMBED, validate_base_tensors
from specbuild.builder.checkpoint.fused_tensors import unfuse
from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.checkpoint.weights_io import load_hf_weights
from specbuild.errors import SpecbuildError
from specbuild.plugins.draft_target import DRAFT_VOCAB_FILE, DRAFT_VOCAB_TENSOR, EMBEDDINGS_FROM_TARGET

TOKENIZER = "tokenizer.json"
OWN_KEY = "specbuild"  # config.json's specbuild section (embeddings, draft_vocab, lineage): not a model field
CHOSEN_KEY, CHOICE_KEY = "specbuild_defaults", "specbuild_choice"  # written by training/defaults.choose_for_recipe
DEFAULT_KEYS = {
    "num_draft_tokens": "default_num_draft_tokens",
    "draft_vocab_size": "default_vocab_size",
    "draft_top_k": "default_draft_top_k",
    "draft_weights": "default_draft_weights",  # the draft's roundings never change the output: its cheapest weights
}


def convert_draft_model(head_dir: Path, model: ModelConfig, base: dict, base_dir: Path | None = None):
    """(head config, tensors) of the draft model in `head_dir` for the target `model` (its tensors `base`)."""
    config_file = head_dir / "config.json"
    if not config_file.is_file():
        raise SpecbuildError(f"{config_file}: missing (a draft model directory is a Hugging Face model directory)")
    raw = read_json(config_file)
    own = raw.pop(OWN_KEY, None) or {}
    if not isinstance(own, dict):
        raise SpecbuildError(f"{config_file}: {OWN_KEY} must be an object")
    # a recipe's `choose` stage records the measured defaults as specbuild_defaults (build options), with its table
    chosen = raw.pop(CHOSEN_KEY, None) or {}
    raw.pop(CHOICE_KEY, None)
    if not isinstance(chosen, dict):
        raise SpecbuildError(f"{config_file}: {CHOSEN_KEY} must be an object")
    own = {
        **own,
        **{DEFAULT_KEYS[k]: _default(chosen, k, CHOSEN_KEY, config_file) for k in chosen if k in DEFAULT_KEYS},
    }
    by_weights = chosen.get("by_weights") or {}  # another choice for some --weights (int4: drafts cost more there)
    if not isinstance(by_weights, dict) or not all(isinstance(v, dict) for v in by_weights.values()):
        raise SpecbuildError(f"{config_file}: {CHOSEN_KEY}.by_weights must map weights to build options")
    draft = ModelConfig.from_hf(raw, source=str(config_file))
    check_same_vocabulary(draft, model, config_file)
    if base_dir is not None:
        check_same_tokenizer(head_dir, Path(base_dir))
    tensors = load_hf_weights(head_dir, progress=False)
    embeddings = own.get("embeddings")
    if embeddings is not None and embeddings != EMBEDDINGS_FROM_TARGET:
        raise SpecbuildError(f"{config_file}: {OWN_KEY}.embeddings {embeddings!r}: expected {EMBEDDINGS_FROM_TARGET!r}")
    if embeddings == EMBEDDINGS_FROM_TARGET and EMBED not in tensors:
        if draft.hidden_size != model.hidden_size:
            raise SpecbuildError(
                f"{config_file}: {OWN_KEY}.embeddings is 'target' but hidden_size {draft.hidden_size} differs from the "
                f"target's {model.hidden_size}"
            )
        tensors[EMBED] = base[EMBED]
    tensors = unfuse(draft, tensors, str(head_dir))
    tensors = {name: tensors[name] for name in validate_base_tensors(draft, tensors, source=str(head_dir))}
    vocab = read_draft_vocab(head_dir, draft.vocab_size)
    cfg = {
        "model": draft.to_dict(),
        "source": str(head_dir.resolve()),
        "lineage": own.get("lineage"),
        "draft_vocab_size": None if vocab is None else len(vocab),
        # the draft's measured CPU defaults (its training recipe's choice), used when the build does not set them
        "default_vocab_size": _positive(own, "default_vocab_size", config_file),
        "default_num_draft_tokens": _positive(own, "default_num_draft_tokens", config_file),
        "default_draft_top_k": _positive(own, "default_draft_top_k", config_file),
        "default_draft_weights": _weights(own, "default_draft_weights", config_file),
        "defaults_by_weights": {
            w: {
                DEFAULT_KEYS[k]: _default(d, k, f"{CHOSEN_KEY}.by_weights.{w}", config_file)
                for k in DEFAULT_KEYS
                if k in d
            }
            for w, d in by_weights.items()
        },
    }
    if vocab is not None:
        tensors[DRAFT_VOCAB_TENSOR] = torch.tensor(vocab, dtype=torch.int64)
    return cfg, tensors


def _default(chosen: dict, key: str, where: str, source):
    """One recorded build option of `chosen` (a DEFAULT_KEYS name), checked."""
    if key == "draft_weights":
        return _weights(chosen, key, source, where)
    return _positive(chosen, key, source, where)


def _positive(own: dict, key: str, source, where: str = OWN_KEY) -> int | None:
    value = own.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SpecbuildError(f"{source}: {where}.{key} {value!r} is not an integer >= 1")
    return value


def _weights(own: dict, key: str, source, where: str = OWN_KEY) -> str | None:
    value = own.get(key)
    if value is not None and value not in ef.WEIGHTS:
        raise SpecbuildError(f"{source}: {where}.{key} {value!r} is not one of {', '.join(ef.WEIGHTS)}")
    return value


def check_same_vocabulary(draft: ModelConfig, target: ModelConfig, source) -> None:
    """Vocabulary size and BOS id of the draft's config against the target's (the tokenizers' special tokens are
    compared by check_same_tokenizer; EOS ids are the target's business: it decides where generation stops)."""
    if draft.vocab_size != target.vocab_size:
        raise SpecbuildError(
            f"{source}: the draft's vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}; a "
            "draft model must share the target's tokenizer"
        )
    if draft.bos_token_id != target.bos_token_id:
        raise SpecbuildError(
            f"{source}: the draft's bos_token_id {draft.bos_token_id} differs from the target's {target.bos_token_id}"
        )


def check_same_tokenizer(draft_dir: Path, target_dir: Path) -> None:
    """The two tokenizer.json files map every token string to the same id and mark the same special tokens."""
    target_file, draft_file = target_dir / TOKENIZER, draft_dir / TOKENIZER
    if not target_file.is_file():
        return  # a target without tokenizer.json: the vocabulary size was all there is to compare
    if not draft_file.is_file():
        raise SpecbuildError(f"{draft_file}: missing; the draft's tokenizer must be checked against the target's")
    from tokenizers import Tokenizer

    loaded = []
    for file in (draft_file, target_file):
        try:
            loaded.append(Tokenizer.from_file(str(file)))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on a damaged file
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise SpecbuildError(f"{file}: cannot read the tokenizer ({reason})") from None
    draft, target = loaded
    draft_vocab, target_vocab = draft.get_vocab(with_added_tokens=True), target.get_vocab(with_added_tokens=True)
    for token, index in target_vocab.items():
        other = draft_vocab.get(token)
        if other != index:
            where = "has no such token" if other is None else f"gives id {other}"
            raise SpecbuildError(
                f"{draft_file}: token {json.dumps(token)} is id {index} in the target's tokenizer but the draft's "
                f"{where}; a draft model must share the target's tokenizer"
            )
    extra = [t for t in draft_vocab if t not in target_vocab]
    if extra:
        raise SpecbuildError(
            f"{draft_file}: token {json.dumps(extra[0])} (id {draft_vocab[extra[0]]}) is not in the target's tokenizer"
        )
    specials = [{k: v.content for k, v in t.get_added_tokens_decoder().items() if v.special} for t in loaded]
    if specials[0] != specials[1]:
        differ = sorted(set(specials[0].items()) ^ set(specials[1].items()))[0]
        raise SpecbuildError(
            f"{draft_file}: special token {json.dumps(differ[1])} (id {differ[0]}) is special in only one of the "
            "draft's and the target's tokenizers"
        )


def read_draft_vocab(head_dir: Path, vocab_size: int) -> list[int] | None:
    """draft_vocab.json's token ids (most frequent first), checked; None without the file."""
    file = head_dir / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    data = read_json(file)
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not ids:
        raise SpecbuildError(f"{file}: expected an object with a non-empty list token_ids")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise SpecbuildError(f"{file}: token_ids holds {i!r}, not a token id below vocab_size {vocab_size}")
    if len(set(ids)) != len(ids):
        raise SpecbuildError(f"{file}: token_ids lists a token more than once")
    return ids


def load_hf_assistant(draft_dir: Path, target):
    """The draft in `draft_dir` as a transformers model for assisted generation with `target` (float32, eval); a
    draft that takes the target's embedding gets it (and its tied lm_head). None: no such draft directory."""
    config_file = Path(draft_dir) / "config.json"
    if not config_file.is_file():
        return None
    own = read_json(config_file).get(OWN_KEY) or {}
    from transformers import AutoModelForCausalLM

    if own.get("embeddings") != EMBEDDINGS_FROM_TARGET:
        return AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    import transformers

    logging = transformers.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # the embedding is missing from the file on purpose: it is set next
    try:
        model = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32)
    finally:
        logging.set_verbosity(level)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
    model.tie_weights()
    return model.eval()
