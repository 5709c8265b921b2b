"""The extras (setup.py) a command needs beyond the base install, and the one-line error when one is missing.

`pip install specbuild` runs and inspects engines; building, converting and training need torch and transformers
(`specbuild[build]`, `specbuild[train]`). The check looks modules up without importing them.
"""

from __future__ import annotations

import functools
import importlib.util

import click

from specbuild.errors import SpecbuildError

# extra -> modules whose absence means the extra is not installed
EXTRA_MODULES = {
    "build": ("torch", "transformers", "onnxscript", "safetensors"),
    "train": ("torch", "transformers", "onnxscript", "safetensors"),
    "serve": ("starlette", "uvicorn", "prometheus_client"),
    "triton": ("pytriton", "starlette", "prometheus_client"),
}


def missing_modules(extra: str) -> list[str]:
    return [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]


def require_extra(extra: str, command: str) -> None:
    """A one-line SpecbuildError naming the extra to install when one of its modules is missing."""
    missing = missing_modules(extra)
    if missing:
        raise SpecbuildError(
            f"specbuild {command} needs the {extra} extra ({', '.join(missing)} not installed): "
            f"pip install 'specbuild[{extra}]'"
        )


def needs_extra(extra: str):
    """Command decorator (below handle_errors): check the extra before the command runs."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            require_extra(extra, click.get_current_context().info_name)
            return func(*args, **kwargs)

        return wrapper

    return decorate
