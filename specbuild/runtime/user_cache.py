"""Small JSON records kept between runs in the user's cache directory: what a machine measured or verified once
(row invariance of an engine's kernels, hashes of engine files) so that loading an engine pays for it once.

Location: $SPECBUILD_CACHE_DIR, else $XDG_CACHE_HOME/specbuild, else ~/.cache/specbuild. One file per record kind,
replaced atomically; concurrent writers may lose each other's newest entry (it is measured again next time), never
corrupt a file. A cache that cannot be read or written is ignored: everything is then measured on every load.
SPECBUILD_CACHE_DIR=off disables it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

MAX_ENTRIES = 512  # per record kind: the oldest entries are dropped beyond it


def cache_dir() -> Path | None:
    explicit = os.environ.get("SPECBUILD_CACHE_DIR", "").strip()
    if explicit.lower() in ("off", "0"):
        return None
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return Path(base) / "specbuild" if base else Path.home() / ".cache" / "specbuild"


def _file(kind: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / f"{kind}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def get(kind: str, key: str):
    """The record kept under `key`, or None."""
    path = _file(kind)
    return None if path is None else _read(path).get(key)


def put(kind: str, key: str, value) -> None:
    """Keep `value` (JSON-serialisable) under `key`; silently does nothing if the cache cannot be written."""
    path = _file(kind)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        records = _read(path)
        records.pop(key, None)
        records[key] = value
        while len(records) > MAX_ENTRIES:
            records.pop(next(iter(records)))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{kind}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(records, fh)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return
