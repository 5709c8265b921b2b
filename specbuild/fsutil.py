"""Output directories that are written atomically and never destroy what is not ours, even when interrupted.

Outputs. `prepare_output_dir` checks an output path before any work starts: not an existing file, no overlap with
an input (equal, containing it, inside it), and `--overwrite` replaces only a previous specbuild output (a
checkpoint's config.yaml, an engine's engine.yaml, or the OUTPUT_MARKER file). It records what is at the path.
`atomic_output_dir` then builds into a temporary sibling `.<name>.specbuild-tmp-<pid>-<hex>`, flock-ed for the life
of the run, and commits under an exclusive flock on the parent directory (so concurrent runs serialize): the output
path must still hold what it held at the start (a directory that appeared meanwhile is never removed; the run fails
with one line), a replaced output is first moved aside into a locked `.<name>.specbuild-old-<pid>-<hex>`, the new
one is renamed into place, then the old one is deleted. Any failure before that restores the previous state. Each
run first cleans the tagged siblings whose lock it can take (their owner died, even by SIGKILL): temporaries are
deleted, an aside directory is renamed back if the output path is empty (a run killed in mid-commit).

Interrupts (specbuild/interrupts.py) are checked right before a commit and deferred during it (the commit is then
rolled back) and during cleanup. Inside `provisional_commits` (the convert and build commands) a commit stays
revocable until the block ends, so an interrupt arriving after the last rename still leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import secrets
import shutil
import stat
import sys
import time
from pathlib import Path

import yaml

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError, as_specbuild_error, describe_os_error
from specbuild.interrupts import INTERRUPTS, check_interrupted

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no locking
    fcntl = None

TMP_TAG = ".specbuild-tmp-"
OLD_TAG = ".specbuild-old-"
OUTPUT_MARKER = ".specbuild-output"  # marks outputs without a specbuild manifest (the default model's HF directory)
MAX_MANIFEST_BYTES = 1 << 20
_MANIFESTS = ((ef.CHECKPOINT_CONFIG, ef.CHECKPOINT_FORMAT), (ef.ENGINE_MANIFEST, ef.ENGINE_FORMAT))


# ---------------------------------------------------------------- output directories
def is_specbuild_output(path: str | os.PathLike) -> bool:
    """A directory holding a specbuild checkpoint or engine manifest, or the OUTPUT_MARKER file."""
    path = Path(path)
    if (path / OUTPUT_MARKER).is_file():
        return True
    for name, fmt in _MANIFESTS:
        try:
            with open(path / name, "rb") as f:
                data = yaml.safe_load(f.read(MAX_MANIFEST_BYTES))
        except (OSError, ValueError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and data.get("format") == fmt:
            return True
    return False


def existing_paths(*candidates) -> list[Path]:
    """The candidates that are paths to something existing (strings that are not paths are skipped)."""
    out = []
    for item in candidates:
        if isinstance(item, (str, os.PathLike)):
            try:
                if os.path.lexists(item):
                    out.append(Path(item))
            except (OSError, ValueError):
                pass
    return out


def check_no_overlap(output: str | os.PathLike, inputs) -> None:
    """Refuse an output path equal to, containing, or inside any of `inputs` (files or directories)."""
    final = _resolve(output)
    for item in inputs:
        if item is None:
            continue
        try:
            src = Path(item).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):
            continue
        if src == final or _same_file(src, final):
            raise SpecbuildError(f"output directory {output} is the input {item}; choose another output directory")
        if final in src.parents:
            raise SpecbuildError(
                f"output directory {output} contains the input {item}; choose an output directory that does not"
            )
        if src in final.parents:
            raise SpecbuildError(
                f"output directory {output} is inside the input directory {item}; choose one outside it"
            )


@dataclasses.dataclass(frozen=True)
class OutputTarget:
    """An output path checked by prepare_output_dir, and what was there at that moment."""

    path: Path  # absolute, symlinks resolved
    shown: str  # as given (for messages)
    existing: tuple[int, int] | None  # (st_dev, st_ino) of the directory there at the start
    kind: str | None  # "empty" (an empty directory) or "output" (a previous specbuild output, --overwrite)


def prepare_output_dir(path: str | os.PathLike, *, overwrite: bool = False, inputs=()) -> OutputTarget:
    """Check an output directory before any work starts (see the module docstring); one-line errors."""
    shown = os.fspath(path)
    final = _resolve(path)
    if final.parent == final:
        raise SpecbuildError(f"{shown}: cannot be an output directory; choose a new directory")
    check_no_overlap(shown, inputs)
    try:
        st = os.stat(final)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise SpecbuildError(describe_os_error(exc, shown)) from None
    kind = None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise SpecbuildError(f"{shown}: exists and is not a directory; choose another output directory")
        if _is_empty(final, shown):
            kind = "empty"
        elif not overwrite:
            raise SpecbuildError(f"output directory {shown} already exists (pass --overwrite to replace it)")
        elif is_specbuild_output(final):
            kind = "output"
        else:
            raise SpecbuildError(
                f"output directory {shown} is not a specbuild output (no specbuild config.yaml or engine.yaml); "
                "--overwrite replaces only those: remove it yourself or choose another output directory"
            )
    _check_parent_writable(final.parent, shown)
    return OutputTarget(final, shown, (st.st_dev, st.st_ino) if st is not None else None, kind)


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike | OutputTarget, overwrite: bool = False, inputs=(), mark: bool = False):
    """Yield a temporary directory that becomes the output path only if the block succeeds.

    `path` is a path (checked here with `overwrite` and `inputs`) or an OutputTarget from prepare_output_dir (the
    state recorded then is what the commit expects). A failure or interrupt anywhere removes the temporary
    directory (and any parent directories created here): nothing partial is ever left at the output path. OS errors
    (disk full, file too large, permissions) become one SpecbuildError naming the path. `mark` writes
    OUTPUT_MARKER so that a later --overwrite recognises the directory as ours.
    """
    target = path if isinstance(path, OutputTarget) else prepare_output_dir(path, overwrite=overwrite, inputs=inputs)
    check_interrupted()
    final = target.path
    created: list[Path] = []
    tmp, tmp_fd = None, None
    try:
        try:
            with INTERRUPTS.deferred():  # what is created is always recorded, so always removed
                created = _make_parents(final.parent, target.shown)
            check_interrupted()
            with locked_dir(final.parent):
                clean_stale(final.parent)
                with INTERRUPTS.deferred():
                    tmp, tmp_fd = _make_locked_dir(final.parent, f".{final.name[:200]}{TMP_TAG}")
            check_interrupted()
            yield tmp
            check_interrupted()
            if mark:
                (tmp / OUTPUT_MARKER).write_text("written by specbuild; `--overwrite` may replace this directory\n")
            commit = _commit(target, tmp)
        except BaseException as exc:
            INTERRUPTS.mark_handled()
            with INTERRUPTS.deferred():
                if INTERRUPTS.signum is not None:
                    INTERRUPTS.aborted.append(target.shown)
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                _remove_created(created)
            if isinstance(exc, Exception):
                converted = as_specbuild_error(exc, target.shown)
                if converted is None and isinstance(exc, SpecbuildError) and tmp is not None and str(tmp) in str(exc):
                    converted = exc
                if converted is not None:
                    message = str(converted) if tmp is None else str(converted).replace(str(tmp), target.shown)
                    raise SpecbuildError(message) from exc
            raise
    finally:
        if tmp_fd is not None:
            os.close(tmp_fd)
    if not commit.provisional:
        with INTERRUPTS.deferred():
            commit.finalize()
        check_interrupted()


_PROVISIONAL: list | None = None


@contextlib.contextmanager
def provisional_commits():
    """Commits made inside the block stay revocable until it ends.

    If the block raises (an interrupt arriving after the last rename, say), every output committed inside it is
    removed again and what it replaced is restored; otherwise the replaced outputs are deleted at the end.
    """
    global _PROVISIONAL
    outer, _PROVISIONAL = _PROVISIONAL, []
    commits = _PROVISIONAL
    try:
        yield
        check_interrupted()
    except BaseException:
        INTERRUPTS.mark_handled()
        with INTERRUPTS.deferred():
            for commit in reversed(commits):
                commit.rollback()
                if INTERRUPTS.signum is not None:
                    INTERRUPTS.aborted.append(commit.shown)
        raise
    finally:
        _PROVISIONAL = outer
    with INTERRUPTS.deferred():
        for commit in commits:
            commit.finalize()
    check_interrupted()


@dataclasses.dataclass
class _Commit:
    final: Path
    shown: str
    new_id: tuple[int, int]
    aside: Path | None = None
    aside_fd: int | None = None
    aside_kind: str | None = None
    provisional: bool = False

    def finalize(self) -> None:
        """Delete what the output replaced."""
        if self.aside is not None:
            if self.aside_kind == "empty":
                with contextlib.suppress(OSError):
                    os.rmdir(self.aside)
            else:
                shutil.rmtree(self.aside, ignore_errors=True)
        self._close()

    def rollback(self) -> None:
        """Take the new output away again and put back what was there (if the output is still ours)."""
        try:
            with locked_dir(self.final.parent, timeout=30):
                self._rollback_locked()
        except OSError:
            self._close()  # the previous output stays aside, unlocked: the next run puts it back

    def _rollback_locked(self) -> None:
        trash = None
        with contextlib.suppress(OSError):
            if _dir_id(self.final) == self.new_id:
                trash = _unique_name(self.final.parent, f".{self.final.name[:200]}{TMP_TAG}")
                os.rename(self.final, trash)
        if self.aside is not None and (trash is not None or not os.path.lexists(self.final)):
            with contextlib.suppress(OSError):
                os.rename(self.aside, self.final)
                self.aside = None
            if self.aside is not None:  # could not put it back: leave it aside for the next run to restore
                self.aside = None
                self._close()
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self.finalize()  # another output replaced ours meanwhile: what ours replaced goes

    def _close(self) -> None:
        if self.aside_fd is not None:
            os.close(self.aside_fd)
            self.aside_fd = None


def _commit(target: OutputTarget, tmp: Path) -> _Commit:
    """Rename `tmp` into place under the parent's lock, after checking the output path holds what it held."""
    final, shown = target.path, target.shown
    with locked_dir(final.parent):
        with INTERRUPTS.deferred():
            check_interrupted()
            current = _dir_id(final) if os.path.lexists(final) else None
            commit = _Commit(final, shown, _dir_id(tmp))
            if current is not None:
                if current != target.existing:
                    raise SpecbuildError(
                        f"output directory {shown} appeared while this run was writing it; it was left untouched "
                        "and nothing was written"
                    )
                if target.kind == "empty" and not _is_empty(final, shown):
                    raise SpecbuildError(
                        f"output directory {shown} is no longer empty; it was left untouched and nothing was written"
                    )
                if target.kind == "output" and not is_specbuild_output(final):
                    raise SpecbuildError(
                        f"output directory {shown} no longer holds a specbuild output; it was left untouched and "
                        "nothing was written"
                    )
                try:
                    commit.aside_fd = _open_locked(final)
                except BlockingIOError:
                    raise SpecbuildError(
                        f"output directory {shown} is being written by another specbuild run; nothing was written"
                    ) from None
                aside = _unique_name(final.parent, f".{final.name}{OLD_TAG}")
                try:
                    os.rename(final, aside)
                except BaseException:
                    commit._close()
                    raise
                commit.aside, commit.aside_kind = aside, target.kind
            try:
                _rename_noreplace(tmp, final)
            except BaseException as exc:
                if commit.aside is not None:
                    os.rename(commit.aside, final)
                    commit.aside = None
                commit._close()
                if isinstance(exc, FileExistsError) or getattr(exc, "errno", None) == errno.ENOTEMPTY:
                    raise SpecbuildError(
                        f"output directory {shown} appeared while this run was writing it; it was left untouched "
                        "and nothing was written"
                    ) from None
                raise
            if INTERRUPTS.signum is not None:  # arrived during the commit: undo it
                commit._rollback_locked()
                raise INTERRUPTS.exception()
            if _PROVISIONAL is not None:  # registered before any signal can strike again
                commit.provisional = True
                _PROVISIONAL.append(commit)
    return commit


def clean_stale(parent: str | os.PathLike) -> list[Path]:
    """Remove the temporary directories of dead runs in `parent` (restore a moved-aside output); returns them.

    Call with the parent's lock held. A directory whose lock is held belongs to a live run and is left alone.
    """
    parent = Path(parent)
    done = []
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(".") and (TMP_TAG in e.name or OLD_TAG in e.name)]
    except OSError:
        return done
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            fd = _open_locked(entry.path, must_lock=True)
        except OSError:  # BlockingIOError: alive (or no flock here: then nothing is ever cleaned)
            continue
        try:
            path = Path(entry.path)
            if OLD_TAG in entry.name:
                output = parent / entry.name[1 : entry.name.index(OLD_TAG)]
                if output.name and not os.path.lexists(output):
                    os.rename(path, output)  # a run died mid-commit: put the previous output back
                    done.append(path)
                    continue
            shutil.rmtree(path, ignore_errors=True)
            done.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


# ---------------------------------------------------------------- helpers
def _resolve(path) -> Path:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "symbolic link loop"
        raise SpecbuildError(f"{os.fspath(path)}: {reason}") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_empty(path: Path, shown: str) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except OSError as exc:
        raise SpecbuildError(describe_os_error(exc, shown)) from None


def _dir_id(path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def _check_parent_writable(parent: Path, shown: str) -> None:
    existing = parent
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise SpecbuildError(f"{existing}: not a directory (cannot create output directory {shown})")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecbuildError(f"{existing}: permission denied (cannot create output directory {shown} there)")


def _make_parents(parent: Path, shown: str) -> list[Path]:
    """Create the missing parent directories; returns those created (outermost first)."""
    missing = []
    while not os.path.lexists(parent) and parent.parent != parent:
        missing.append(parent)
        parent = parent.parent
    created = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError as exc:
            _remove_created(created)
            raise SpecbuildError(f"{describe_os_error(exc, path)} (cannot create output directory {shown})") from None
        created.append(path)
    return created


def _remove_created(created: list[Path]) -> None:
    for path in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _unique_name(parent: Path, prefix: str) -> Path:
    while True:
        path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        if not os.path.lexists(path):
            return path


def _make_locked_dir(parent: Path, prefix: str) -> tuple[Path, int]:
    """A new directory `<prefix><pid>-<hex>` in `parent` (mode from the umask), flock-ed; returns (path, fd)."""
    for _ in range(100):
        path = _unique_name(parent, prefix)
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        except OSError as exc:
            raise SpecbuildError(f"{parent}: {exc.strerror} (cannot create the output directory there)") from None
        return path, _open_locked(path)
    raise SpecbuildError(f"{parent}: cannot create a temporary directory")


def _open_locked(path, must_lock: bool = False) -> int:
    """An fd of the directory `path` holding an exclusive flock (BlockingIOError if another process holds it).

    Without flock support (no fcntl, or a filesystem that refuses it) the fd comes unlocked, or with `must_lock`
    the error is raised.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        if fcntl is None:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if must_lock or isinstance(exc, BlockingIOError):
            os.close(fd)
            raise
    return fd


@contextlib.contextmanager
def locked_dir(path: Path, timeout: float | None = None):
    """Hold an exclusive flock on the directory `path` (waits; gives up silently after `timeout` seconds)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        if fcntl is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                except OSError:  # no flock on this filesystem
                    break
        yield
    finally:
        os.close(fd)


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_renameat2 = None


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(src, dst) that fails with FileExistsError if dst exists (atomic with Linux renameat2)."""
    global _renameat2
    if _renameat2 is None:
        _renameat2 = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
                _renameat2 = fn
            except (OSError, AttributeError):
                pass
    if _renameat2:
        import ctypes

        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EPERM, getattr(errno, "ENOTSUP", errno.EINVAL)):
            raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
    os.rename(src, dst)
