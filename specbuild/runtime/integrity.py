"""Engine file records: the size and sha256 of every file of an engine directory, kept in engine.yaml.

`record_files` runs at the end of `specbuild build`, after every file is written. Loading an engine checks the
sizes (one stat per file: catches truncated, missing and swapped-size files) and, once per file identity (path,
device, inode, size, modification and change times), the sha256 hashes (`verify_once`: catches same-size
replacements; the verified identities are kept in the user cache, so an unchanged engine is hashed once per
machine, and not at all on the one that built it: `remember_verified`; the engine loads its graph meanwhile).
`specbuild inspect --verify` hashes every file again. hashlib only: the runtime never imports torch or the builder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime import user_cache

HASH_ALGORITHM = "sha256"
VERIFIED_CACHE = "verified-files"
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


_WRITTEN: dict[tuple, str] = {}  # (device, inode, size, mtime) of a file this process wrote -> its sha256


def _written_key(path: Path) -> tuple:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remember_written(path, sha256: str) -> None:
    """The sha256 of a file this process has just written, taken as it wrote it (the builder's weights file):
    record_files takes it instead of reading the file again while the file is unchanged (same device, inode, size
    and modification time; a rename keeps them, any write or a new file in its place does not)."""
    _WRITTEN[_written_key(Path(path))] = sha256


def record_files(engine_dir) -> dict[str, dict]:
    """{relative posix path: {"size": bytes, "sha256": hex}} for every file under engine_dir but engine.yaml."""
    engine_dir = Path(engine_dir)
    records = {}
    for path in sorted(p for p in engine_dir.rglob("*") if p.is_file()):
        name = path.relative_to(engine_dir).as_posix()
        if name == ef.ENGINE_MANIFEST:
            continue
        digest = _WRITTEN.get(_written_key(path)) or file_sha256(path)
        records[name] = {"size": path.stat().st_size, HASH_ALGORITHM: digest}
    return records


def remember_verified(engine_dir, records: dict[str, dict]) -> None:
    """Keep the files of `records` as verified (their identities, as verify_once does) without hashing them again:
    for the build, which has just hashed what it wrote, so that the engine's first load on this machine does not
    (at the 1B shape, a third of the load: docs/benchmarks/design-measurements.md)."""
    for name, record in records.items():
        user_cache.put(VERIFIED_CACHE, _identity(Path(engine_dir) / name, record[HASH_ALGORITHM]), True)


def check_sizes(engine_dir, records: dict[str, dict]) -> None:
    """Every recorded file exists with its recorded size; else one SpecbuildError naming the file."""
    engine_dir = Path(engine_dir)
    for name, record in records.items():
        path = engine_dir / name
        if not path.is_file():
            raise SpecbuildError(
                f"{path}: missing from the engine directory (engine.yaml records it); rebuild the engine"
            )
        size = path.stat().st_size
        if size != record["size"]:
            raise SpecbuildError(
                f"{path}: {size} bytes, but engine.yaml records {record['size']}; the file is truncated or "
                f"was replaced, rebuild the engine"
            )


def _identity(path: Path, sha256: str) -> str:
    """What changes whenever the file may have: its real path, device, inode, size, mtime and ctime (ctime cannot be
    set back by a user), with the hash it must have."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{sha256}"


def verify_once(engine_dir, records: dict[str, dict]) -> int:
    """Check the sha256 of every recorded file not verified before with the same identity (see _identity); raise
    one SpecbuildError at the first mismatch. Returns the bytes hashed (0 when every file was verified before)."""
    engine_dir = Path(engine_dir)
    hashed = 0
    for name, record in records.items():
        path = engine_dir / name
        identity = _identity(path, record[HASH_ALGORITHM])
        if user_cache.get(VERIFIED_CACHE, identity):
            continue
        _check_hash(path, record)
        hashed += record["size"]
        user_cache.put(VERIFIED_CACHE, identity, True)
    return hashed


def _check_hash(path: Path, record: dict) -> str:
    """The file's sha256, or one SpecbuildError when it is not the recorded one."""
    digest = file_sha256(path)
    if digest != record[HASH_ALGORITHM]:
        raise SpecbuildError(
            f"{path}: sha256 {digest[:16]}... differs from the {record[HASH_ALGORITHM][:16]}... recorded in "
            f"engine.yaml; the file was modified, rebuild the engine"
        )
    return digest


def verify_hashes(engine_dir, records: dict[str, dict]) -> Iterator[tuple[str, str]]:
    """Check sizes, then yield (name, sha256) per recorded file whose hash matches; raise at the first mismatch."""
    engine_dir = Path(engine_dir)
    check_sizes(engine_dir, records)
    for name, record in records.items():
        yield name, _check_hash(engine_dir / name, record)
