"""The one error type users see: a one-line message naming the file, tensor or value at fault; OS failures as one."""

from __future__ import annotations

import os
import re

_RUST_OS_ERROR = re.compile(r"os error (\d+)")  # how Rust's io::Error ends (safetensors)


class SpecbuildError(Exception):
    """A user-facing failure. The CLI prints `error: <message>` on one line and exits with code 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def describe_os_error(exc: OSError, fallback: str | os.PathLike | None = None) -> str:
    """`<path>: <reason>` for an OSError (`fallback` names the path when the error has none)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    names = [os.fsdecode(n) for n in (exc.filename, exc.filename2) if n is not None]
    where = " -> ".join(names) if names else (os.fspath(fallback) if fallback is not None else None)
    return f"{where}: {reason}" if where else reason


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError that caused `exc` (exc itself, its explicit causes, or its unsuppressed context)."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError):
            return exc
        if isinstance(exc, SpecbuildError):
            exc = exc.__cause__  # a SpecbuildError raised `from` an OSError reports that OSError
        else:
            exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        seen += 1
    return None


def as_specbuild_error(exc: Exception, fallback: str | os.PathLike | None = None) -> SpecbuildError | None:
    """One SpecbuildError naming the path for an OS-level failure (any exception type), else None."""
    oserr = _os_error_in(exc)
    if oserr is not None and isinstance(exc, SpecbuildError):  # keep its message; make sure it names the path
        where = oserr.filename if oserr.filename is not None else fallback
        text = str(exc)
        return exc if where is None or os.fsdecode(where) in text else SpecbuildError(f"{os.fsdecode(where)}: {text}")
    if oserr is not None:
        return SpecbuildError(describe_os_error(oserr, fallback))
    match = None if isinstance(exc, SpecbuildError) else _RUST_OS_ERROR.search(str(exc))
    if match:  # e.g. safetensors: "Error while serializing: I/O error: File too large (os error 27)"
        reason = os.strerror(int(match.group(1)))
        return SpecbuildError(f"{fallback}: {reason}" if fallback is not None else reason)
    return None
