"""Atomic output directories: build into a temporary sibling, rename into place at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from specbuild.errors import SpecbuildError


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory that becomes `path` only if the block succeeds.

    A failure (any exception, including KeyboardInterrupt) removes the temporary directory, so no
    partial output is ever left behind.
    """
    final = Path(path)
    if final.exists() and not overwrite:
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        else:
            raise SpecbuildError(f"output directory {final} already exists (pass --overwrite to replace it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
