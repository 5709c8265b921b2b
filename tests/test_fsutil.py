"""Atomic output directories: what is not ours is never removed, temporaries of dead runs are cleaned, concurrent
commits serialize, interrupts (also during the commit) leave the previous state, OS errors name the path."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from specbuild import engine_format as ef
from specbuild import fsutil, interrupts
from specbuild.errors import SpecbuildError
from specbuild.fsutil import atomic_output_dir, prepare_output_dir, provisional_commits

ROOT = Path(__file__).resolve().parent.parent


def tagged(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if fsutil.TMP_TAG in p.name or fsutil.OLD_TAG in p.name)


def fake_engine(path: Path, text: str = "old") -> Path:
    path.mkdir(parents=True)
    (path / ef.ENGINE_MANIFEST).write_text(f"format: {ef.ENGINE_FORMAT}\n")
    (path / "model.onnx").write_text(text)
    return path


def write(out: Path, overwrite: bool = False, text: str = "new") -> None:
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        (tmp / ef.ENGINE_MANIFEST).write_text(f"format: {ef.ENGINE_FORMAT}\n")
        (tmp / "model.onnx").write_text(text)


# ---------------------------------------------------------------- refusals before any work
def test_output_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("keep")
    with pytest.raises(SpecbuildError, match="exists and is not a directory"):
        prepare_output_dir(tmp_path / "f", overwrite=True)
    with pytest.raises(SpecbuildError, match="(?i)not a directory"):
        prepare_output_dir(tmp_path / "f" / "out")
    assert (tmp_path / "f").read_text() == "keep"


def test_output_overlapping_an_input_is_refused(tmp_path):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    recipe = tmp_path / "cfg" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("x")
    for out, inputs, what in [
        (src, [src], "is the input"),
        (tmp_path, [src], "contains the input"),
        (src / "sub" / "out", [src], "inside the input directory"),
        (recipe.parent, [src, recipe], "contains the input"),
    ]:
        with pytest.raises(SpecbuildError, match=what):
            prepare_output_dir(out, overwrite=True, inputs=inputs)
    os.symlink(src, tmp_path / "link")
    with pytest.raises(SpecbuildError, match="is the input"):
        prepare_output_dir(tmp_path / "link", overwrite=True, inputs=[src])
    prepare_output_dir(tmp_path / "elsewhere", inputs=[src, recipe, None, "not-a-path-[[0]]"])


def test_overwrite_replaces_only_specbuild_outputs(tmp_path):
    user = tmp_path / "user"
    (user / "notes").mkdir(parents=True)
    with pytest.raises(SpecbuildError, match="already exists"):
        write(user)
    with pytest.raises(SpecbuildError, match="not a specbuild output"):
        write(user, overwrite=True)
    assert (user / "notes").is_dir()
    old = fake_engine(tmp_path / "engine")
    write(old, overwrite=True)
    assert (old / "model.onnx").read_text() == "new"
    marked = tmp_path / "hf"
    with atomic_output_dir(marked, mark=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert fsutil.is_specbuild_output(marked)
    write(marked, overwrite=True)
    assert not (marked / "config.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    write(empty)  # an existing empty directory needs no --overwrite
    assert (empty / "model.onnx").is_file()
    assert tagged(tmp_path) == []


def test_output_mode_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write(tmp_path / "out")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


# ---------------------------------------------------------------- never remove what is not ours
def test_directory_appearing_during_the_run_is_never_removed(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SpecbuildError, match="appeared while this run was writing it"):
        with atomic_output_dir(out) as tmp:
            (tmp / "model.onnx").write_text("ours")
            out.mkdir()
            (out / "theirs").write_text("keep")
    assert sorted(p.name for p in out.iterdir()) == ["theirs"]
    assert tagged(tmp_path) == []


def test_empty_directory_replaced_during_the_run_is_never_removed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SpecbuildError, match="appeared while this run|no longer empty"):
        with atomic_output_dir(out):
            out.rmdir()
            out.mkdir()  # another directory (the filesystem may reuse the inode number)
            (out / "theirs").write_text("keep")
    assert (out / "theirs").read_text() == "keep"
    (out / "theirs").unlink()
    with pytest.raises(SpecbuildError, match="no longer empty"):
        with atomic_output_dir(out):
            (out / "theirs").write_text("keep")
    assert (out / "theirs").read_text() == "keep"
    old = fake_engine(tmp_path / "engine")
    with pytest.raises(SpecbuildError, match="no longer holds a specbuild output"):
        with atomic_output_dir(old, overwrite=True):
            (old / ef.ENGINE_MANIFEST).unlink()
    assert (old / "model.onnx").read_text() == "old"
    assert tagged(tmp_path) == []


def test_failure_leaves_nothing_not_even_created_parents(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "x").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_os_errors_become_one_line_naming_the_path(tmp_path):
    out = tmp_path / "out"

    def fail(exc):
        with pytest.raises(SpecbuildError) as info:
            with atomic_output_dir(out) as tmp:
                raise exc(tmp) if callable(exc) else exc
        assert list(tmp_path.iterdir()) == []
        return str(info.value)

    assert fail(OSError(errno.EFBIG, "File too large")) == f"{out}: File too large"
    assert fail(lambda tmp: OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.onnx.data"))) == (
        f"{out / 'model.onnx.data'}: No space left on device"
    )

    class SafetensorError(Exception):  # safetensors reports Rust io errors in its own type
        pass

    text = "Error while serializing: I/O error: File too large (os error 27)"
    assert fail(SafetensorError(text)) == f"{out}: {os.strerror(27)}"

    def wrapped(_tmp):  # the exporter wraps the OSError of its write into its own one-line error
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError as exc:
            raise SpecbuildError("ONNX export failed: [Errno 27] File too large") from exc

    assert fail(lambda tmp: _raised(wrapped, tmp)) == f"{out}: ONNX export failed: [Errno 27] File too large"
    assert fail(lambda tmp: SpecbuildError(f"{tmp / 'model.onnx'}: bad graph")) == f"{out / 'model.onnx'}: bad graph"


def _raised(func, *args):
    try:
        func(*args)
    except Exception as exc:  # noqa: BLE001 - returned to be raised again inside the block
        return exc
    raise AssertionError("no exception")


def test_unwritable_parent_is_one_line(tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):  # a read-only directory, also when the tests run as root
        if Path(path).parent == parent:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(SpecbuildError, match=f"{parent}: Permission denied"):
        write(parent / "out")
    with pytest.raises(SpecbuildError, match="Permission denied"):
        write(parent / "sub" / "out")
    assert list(parent.iterdir()) == []


# ---------------------------------------------------------------- other runs: dead, live, concurrent
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from specbuild.fsutil import atomic_output_dir
    out, mode = Path(sys.argv[1]), sys.argv[2]
    try:
        with atomic_output_dir(out) as tmp:
            (tmp / "who").write_text(str(os.getpid()))
            print("ready", tmp, flush=True)
            if mode == "hang":
                time.sleep(120)
            else:
                sys.stdin.readline()  # wait for the go
        print("committed", flush=True)
    except Exception as exc:
        print("failed", exc, flush=True)
    """
)


def child(out: Path, mode: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    line = proc.stdout.readline().split()
    assert line[0] == "ready", line
    return proc, Path(line[1])


def test_temporaries_of_dead_runs_are_cleaned_live_ones_kept(tmp_path):
    dead, dead_tmp = child(tmp_path / "a", "hang")
    live, live_tmp = child(tmp_path / "b", "hang")
    try:
        dead.kill()  # SIGKILL: no cleanup of its own
        dead.wait(10)
        assert dead_tmp.is_dir() and live_tmp.is_dir()
        write(tmp_path / "c")
        assert not dead_tmp.exists() and live_tmp.is_dir()
    finally:
        live.kill()
        live.wait(10)
    write(tmp_path / "d")
    assert tagged(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]


def test_output_moved_aside_by_a_killed_run_is_restored(tmp_path):
    aside = fake_engine(tmp_path / f".engine{fsutil.OLD_TAG}999999-0abc")
    write(tmp_path / "other")
    assert (tmp_path / "engine" / "model.onnx").read_text() == "old"  # the output path was empty: put back
    aside = fake_engine(tmp_path / f".engine{fsutil.OLD_TAG}999999-0abd")
    write(tmp_path / "other2")
    assert not aside.exists()  # the output path holds the new output: the old one goes
    assert tagged(tmp_path) == []


def test_commits_serialize_on_the_parent_lock(tmp_path):
    proc, _ = child(tmp_path / "out", "wait")
    with fsutil.locked_dir(tmp_path):
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(1.0)
        assert proc.poll() is None and not (tmp_path / "out").exists()  # waiting for the lock
    assert proc.stdout.readline().strip() == "committed"
    proc.wait(10)
    assert (tmp_path / "out" / "who").read_text() == str(proc.pid)


def test_two_runs_into_one_output_never_mix(tmp_path):
    out = tmp_path / "out"
    (a, _), (b, _) = child(out, "wait"), child(out, "wait")
    for proc in (a, b):  # both started before either commits
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = sorted(proc.stdout.readline().split()[0] for proc in (a, b))
    for proc in (a, b):
        proc.wait(10)
    assert results == ["committed", "failed"]
    assert sorted(p.name for p in out.iterdir()) == ["who"]
    assert out.joinpath("who").read_text() in (str(a.pid), str(b.pid))
    assert tagged(tmp_path) == []


# ---------------------------------------------------------------- interrupts
def test_provisional_commit_is_rolled_back_and_the_previous_output_restored(tmp_path):
    old = fake_engine(tmp_path / "engine")
    with pytest.raises(KeyboardInterrupt):
        with provisional_commits():
            write(old, overwrite=True)
            assert (old / "model.onnx").read_text() == "new"
            raise KeyboardInterrupt
    assert (old / "model.onnx").read_text() == "old"
    with provisional_commits():
        write(tmp_path / "fresh")
    with pytest.raises(KeyboardInterrupt):
        with provisional_commits():
            write(tmp_path / "gone")
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine", "fresh"]


main_thread_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signal handlers need the main thread"
)


@main_thread_only
def test_signal_during_the_commit_is_deferred_then_rolled_back(tmp_path, monkeypatch):
    old = fake_engine(tmp_path / "engine")
    real = fsutil._rename_noreplace

    def rename_then_signal(src, dst):
        real(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives right after the rename, inside the critical section

    monkeypatch.setattr(fsutil, "_rename_noreplace", rename_then_signal)
    with interrupts.handling_interrupts() as state:
        with pytest.raises(interrupts.Terminated):
            write(old, overwrite=True)
        assert state.signum == signal.SIGTERM
        assert interrupts.interruption_message(signal.SIGTERM) == f"interrupted (SIGTERM); {old} was not written"
    assert (old / "model.onnx").read_text() == "old"
    assert tagged(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


@main_thread_only
def test_swallowed_interrupt_still_prevents_the_commit(tmp_path):
    out = tmp_path / "out"
    with interrupts.handling_interrupts():
        with pytest.raises(KeyboardInterrupt):
            with atomic_output_dir(out) as tmp:
                (tmp / "x").write_text("x")
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1)
                except KeyboardInterrupt:
                    pass  # library code that swallows it (e.g. inside a weakref callback)
    assert list(tmp_path.iterdir()) == []


@main_thread_only
def test_swallowed_interrupt_is_raised_again(tmp_path):
    with interrupts.handling_interrupts():
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                pass
            time.sleep(10)  # busy elsewhere: the interrupt comes again within REARM_S
        assert time.monotonic() - started < 5
