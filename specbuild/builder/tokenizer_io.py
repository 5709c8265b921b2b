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


def carry_tokenizer(model_dir: Path, out_dir: Path) -> bool:
    """Write tokenizer.json (+ tokenizer_config.json) from `model_dir` into `out_dir`.

    Copies an existing tokenizer.json; converts a sentencepiece tokenizer.model with transformers otherwise.
    Returns False, writing nothing, when `model_dir` holds no tokenizer at all.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if (model_dir / ef.TOKENIZER_FILE).is_file():
        for name in (ef.TOKENIZER_FILE, ef.TOKENIZER_CONFIG_FILE):
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, out_dir / name)
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
        return jinja.read_text(encoding="utf-8")
    config_file = model_dir / ef.TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecbuildError(f"{config_file}: invalid JSON ({exc})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) and template else None
