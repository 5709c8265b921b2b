"""The one list of speculative modes, and lookups into it.

Adding a mode is a package `specbuild/plugins/<mode>/` whose `__init__` defines `MODE = ModeSpec(...)`, plus one
line in MODE_PACKAGES. Nothing outside specbuild/plugins names a mode: the CLI, builder, runtime, training and
benchmark ask this module. Importing it (and the mode packages' `__init__`) never imports torch.
"""

from __future__ import annotations

import functools
import importlib

from specbuild.errors import SpecbuildError
from specbuild.modes.spec import ModeOption, ModeSpec

MODE_PACKAGES = (
    "specbuild.plugins.none",
    "specbuild.plugins.medusa",
    "specbuild.plugins.eagle",
    "specbuild.plugins.eagle3",
    "specbuild.plugins.ngram",
    "specbuild.plugins.redrafter",
    "specbuild.plugins.draft_target",
    "specbuild.plugins.lookahead",
    "specbuild.plugins.suffix",
    "specbuild.plugins.recycle",
)


@functools.cache
def modes() -> dict[str, ModeSpec]:
    """{name: ModeSpec} in registry order."""
    out = {}
    for package in MODE_PACKAGES:
        spec = importlib.import_module(package).MODE
        out[spec.name] = spec
    return out


def mode_names() -> tuple[str, ...]:
    return tuple(modes())


def baseline_mode() -> str:
    """The name of plain autoregressive decoding (the default mode)."""
    return next(name for name, spec in modes().items() if spec.baseline)


def get_mode(name: str, option: str = "--speculative-mode") -> ModeSpec:
    """The mode called `name`; a one-line SpecbuildError naming the known modes otherwise."""
    spec = modes().get(name) if isinstance(name, str) else None
    if spec is None:
        raise SpecbuildError(f"{option} {name!r} is not one of {', '.join(modes())}")
    return spec


def mode_options() -> dict[str, ModeOption]:
    """Every mode-specific build option, once (several modes may read the same option, e.g. `tree`)."""
    out: dict[str, ModeOption] = {}
    for spec in modes().values():
        for option in spec.options:
            out.setdefault(option.name, option)
    return out


def modes_reading(option: str) -> list[str]:
    return [name for name, spec in modes().items() if any(o.name == option for o in spec.options)]


def head_modes() -> dict[str, ModeSpec]:
    """Modes with speculative heads to convert (`specbuild convert --<mode>-dir`)."""
    return {name: spec for name, spec in modes().items() if spec.converter}


def trainable_modes() -> dict[str, ModeSpec]:
    return {name: spec for name, spec in modes().items() if spec.trainer}


def load_object(ref: str):
    """Import "package.module:attribute"."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def head_converter(name: str):
    """The head converter of mode `name`."""
    spec = head_modes().get(name)
    if spec is None:
        raise SpecbuildError(
            f"no head converter for speculative mode {name!r} (known: {', '.join(head_modes()) or 'none registered'})"
        )
    return load_object(spec.converter)
