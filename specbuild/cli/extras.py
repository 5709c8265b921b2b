"""The extras (setup.py) a command needs beyond the base install, and the one-line error when one is missing.

`pip install specbuild` runs and inspects engines; building, converting and training need torch and transformers
(`specbuild[build]`, `specbuild[train]`). The check looks modules up without importing them; then the extra's
compiled modules are imported with interrupts deferred: a Ctrl-C landing inside torch's C++ initialisation (which
calls back into Python) aborts the process with `terminate called ...` instead of exiting 130, so it is recorded
and raised once the import is done (about two seconds at most).
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
# extra -> compiled modules imported up front, with interrupts deferred (see the module docstring)
EXTRA_NATIVE_IMPORTS = {"build": ("torch",), "train": ("torch",)}


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


def import_native(extra: str) -> None:
    """Import the extra's compiled modules with SIGINT / SIGTERM only recorded, then raise one that came."""
    from specbuild.interrupts import INTERRUPTS, check_interrupted

    with INTERRUPTS.deferred():
        for name in EXTRA_NATIVE_IMPORTS.get(extra, ()):
            importlib.import_module(name)
    check_interrupted()


def needs_extra(extra: str):
    """Command decorator (below handle_errors): check the extra, import its compiled modules, then run."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            require_extra(extra, click.get_current_context().info_name)
            import_native(extra)
            return func(*args, **kwargs)

        return wrapper

    return decorate
