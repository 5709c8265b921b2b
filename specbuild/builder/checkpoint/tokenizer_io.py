"""Carrying a model's tokenizer into a canonical checkpoint as tokenizer.json (converting sentencepiece if needed).

The runtime tokenizes with the `tokenizers` library only, so a checkpoint must hold a fast-tokenizer tokenizer.json.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError

SENTENCEPIECE_FILE = "tokenizer.model"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Encoded and decoded at convert time: plain ASCII text every Llama-family tokenizer round-trips.
ROUND_TRIP_TEXT = "Hello, world! def add(a, b): return a + b  # 42"


def carry_tokenizer(model_dir: Path, out_dir: Path) -> bool:
    """Write tokenizer.json (+ tokenizer_config.json) from `model_dir` into `out_dir`.

    Copies an existing tokenizer.json; converts a sentencepiece tokenizer.model with transformers otherwise.
    Returns False, writing nothing, when `model_dir` holds no tokenizer at all.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if (model_dir / ef.TOKENIZER_FILE).is_file():
        for name in (ef.TOKENIZER_FILE, ef.TOKENIZER_CONFIG_FILE):
            if (model_dir / name).is_file():
                try:
                    shutil.copyfile(model_dir / name, out_dir / name)
                except OSError as exc:
                    failed = exc.filename if exc.filename else model_dir / name
                    raise SpecbuildError(f"{failed}: cannot copy ({exc.strerror or exc})") from None
        return True
    if (model_dir / SENTENCEPIECE_FILE).is_file():
        _convert_sentencepiece(model_dir, out_dir)
        return True
    return False


def _convert_sentencepiece(model_dir: Path, out_dir: Path) -> None:
    source = model_dir / SENTENCEPIECE_FILE
    try:
        import transformers

        # Without a tokenizer_class, AutoTokenizer falls back to a generic backend that drops the Llama
        # sentencepiece conventions (prefix "▁", BOS); every sentencepiece model of the Llama family uses them.
        cls = transformers.AutoTokenizer if _declares_tokenizer_class(model_dir) else transformers.LlamaTokenizer
        tokenizer = cls.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers raises many types for unconvertible tokenizers
        raise SpecbuildError(
            f"{source}: cannot convert the sentencepiece tokenizer to tokenizer.json ({exc})"
        ) from None
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise SpecbuildError(
            f"{source}: transformers gave a slow {type(tokenizer).__name__}, which has no tokenizer.json form"
        )
    tokenizer.backend_tokenizer.save(str(out_dir / ef.TOKENIZER_FILE))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        saved = Path(tmp) / ef.TOKENIZER_CONFIG_FILE
        if saved.is_file():
            shutil.copyfile(saved, out_dir / ef.TOKENIZER_CONFIG_FILE)


def _declares_tokenizer_class(model_dir: Path) -> bool:
    try:
        config = json.loads((model_dir / ef.TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("tokenizer_class"))


def read_chat_template(model_dir: Path) -> str | None:
    """The chat template from chat_template.jinja or tokenizer_config.json["chat_template"]; None if there is none.

    A list of named templates (older tokenizer_config.json form) yields the one named "default", else the first.
    """
    model_dir = Path(model_dir)
    jinja = model_dir / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecbuildError(f"{jinja}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    config_file = model_dir / ef.TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecbuildError(f"{config_file}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecbuildError(f"{config_file}: invalid JSON ({exc})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) and template else None


def validate_tokenizer(
    tokenizer_file: Path, source: Path, vocab_size: int, chat_template: str | None, template_source: Path
) -> None:
    """Load `tokenizer_file` as the runtime will, round-trip a sample text, render the chat template.

    Errors name `source` (the file the tokenizer came from) or `template_source`: a truncated tokenizer.json, ids
    beyond the model's vocabulary or a template that does not render fail at convert/build time, not at run time.
    """
    from specbuild.runtime.text import TextCodec

    try:
        codec = TextCodec(tokenizer_file)
    except Exception as exc:  # tokenizers raises its own exception type for unparsable files
        raise SpecbuildError(f"{source}: not a valid tokenizer ({_first_line(exc)})") from None
    ids = codec.encode(ROUND_TRIP_TEXT)
    if not ids:
        raise SpecbuildError(f"{source}: encodes {ROUND_TRIP_TEXT!r} to no tokens")
    if max(ids) >= vocab_size:
        raise SpecbuildError(
            f"{source}: encodes {ROUND_TRIP_TEXT!r} to token id {max(ids)}, outside the model's vocab_size "
            f"{vocab_size}; the tokenizer belongs to another model"
        )
    # Characters a small vocabulary cannot encode (no byte fallback) are dropped or become <unk>, as in
    # transformers; everything else must come back exactly (a broken decoder, e.g. "Ġ" in the text, fails here).
    unknown = _unknown_id(codec.tokenizer)

    def covered(char: str) -> bool:
        piece = codec.encode(char)
        return bool(piece) and unknown not in piece and codec.decode(piece, skip_special_tokens=False).strip() == char

    expected = "".join(c for c in ROUND_TRIP_TEXT if not c.isspace() and covered(c))
    back = codec.decode(ids, skip_special_tokens=False)
    if not expected or "".join(back.split()) != expected:
        raise SpecbuildError(f"{source}: does not round-trip text: {ROUND_TRIP_TEXT!r} decodes back as {back!r}")
    if chat_template:
        try:
            TextCodec(tokenizer_file, chat_template).apply_chat("Hello!")
        except Exception as exc:  # jinja2 syntax and render errors
            raise SpecbuildError(f"{template_source}: the chat template does not render ({_first_line(exc)})") from None


def chat_template_source(model_dir: Path) -> Path:
    """The file read_chat_template takes the template from."""
    jinja = Path(model_dir) / CHAT_TEMPLATE_FILE
    return jinja if jinja.is_file() else Path(model_dir) / ef.TOKENIZER_CONFIG_FILE


def _unknown_id(tokenizer) -> int | None:
    """The id of the tokenizer model's unknown token, if it has one."""
    token = getattr(tokenizer.model, "unk_token", None)
    return tokenizer.token_to_id(token) if token else None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
