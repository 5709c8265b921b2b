"""Registry of speculative-head converters: mode name -> function turning a published head directory into tensors.

A converter is called as `converter(head_dir, model_config, base_tensors)` and returns `(head_cfg, head_tensors)`:
a YAML-safe config dict stored in the checkpoint's config.yaml and the tensors written to heads/<mode>.safetensors.
Plugin modules register themselves with `@register_head_converter("medusa")`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specbuild.errors import SpecbuildError

HeadConverter = Callable[[Path, Any, dict], tuple[dict, dict]]
HEAD_CONVERTERS: dict[str, HeadConverter] = {}


def register_head_converter(name: str) -> Callable[[HeadConverter], HeadConverter]:
    """Decorator registering `fn` as the head converter of mode `name`."""

    def decorate(fn: HeadConverter) -> HeadConverter:
        HEAD_CONVERTERS[name] = fn
        return fn

    return decorate


PLUGIN_MODULES = {
    "medusa": "specbuild.plugins.medusa",
    # TODO: point at specbuild.plugins.eagle / eagle3 once those modules exist (they import eagle_convert)
    "eagle": "specbuild.plugins.eagle_convert",
    "eagle3": "specbuild.plugins.eagle_convert",
}


def head_converter(name: str) -> HeadConverter:
    """The converter registered for mode `name`; SpecbuildError naming the known modes otherwise."""
    if name not in HEAD_CONVERTERS and name in PLUGIN_MODULES:
        import importlib

        try:
            importlib.import_module(PLUGIN_MODULES[name])
        except ModuleNotFoundError:
            pass
    try:
        return HEAD_CONVERTERS[name]
    except KeyError:
        known = ", ".join(sorted(HEAD_CONVERTERS)) or "none registered"
        raise SpecbuildError(f"no head converter for speculative mode {name!r} (known: {known})") from None
