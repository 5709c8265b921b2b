"""The real CLI (a subprocess) interrupted by SIGINT / SIGTERM during convert and build: exit 130 / 143 within
seconds, one `error:` line, and neither the output directory nor any temporary sibling left; plus the one-line
errors for outputs that cannot or must not be written (a file, an input, a read-only parent, a file-size limit)."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbuild import engine_format as ef
from specbuild.cli.main import cli
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("cli")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen2_bias"
EXIT_WITHIN_S = 10

# Runs the CLI; an optional hook first wraps yaml.safe_dump so that, right after a checkpoint's config.yaml or an
# engine's engine.yaml text is made (the last step before the commit), it prints a marker and stalls:
#   sleep    - sleeps (an interrupt then lands "near the end", with every file but the manifest written);
#   swallow  - sleeps inside a weakref callback, where Python ignores the KeyboardInterrupt, then goes on;
#   fsize=N  - limits written files to N bytes (Python ignores SIGXFSZ: the write fails with EFBIG);
#   busy     - swallows the interrupt (`except BaseException: pass`), then keeps working for 60 s.
WRAPPER = textwrap.dedent(
    """
    import sys, time, weakref
    hook = sys.argv[1]
    if hook.startswith("fsize="):  # a file-size limit: what a full disk looks like to the writer
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(hook[6:]), int(hook[6:])))
    elif hook != "none":
        import yaml
        from specbuild import engine_format as ef
        real_dump = yaml.safe_dump

        def dump(data, *args, **kwargs):
            text = real_dump(data, *args, **kwargs)
            if isinstance(data, dict) and data.get("format") in (ef.CHECKPOINT_FORMAT, ef.ENGINE_FORMAT):
                print("@@ manifest", file=sys.stderr, flush=True)
                if hook == "sleep":
                    time.sleep(60)
                elif hook == "swallow":
                    class Obj:
                        pass
                    obj = Obj()
                    ref = weakref.ref(obj, lambda _: time.sleep(60))
                    del obj
                elif hook == "busy":
                    try:
                        time.sleep(60)
                    except BaseException:
                        pass
                    time.sleep(60)
            return text

        yaml.safe_dump = dump
    from specbuild.cli.main import cli
    print("@@ started", file=sys.stderr, flush=True)
    cli(args=sys.argv[2:], prog_name="specbuild")
    """
)


class Child:
    """The CLI in a subprocess; stderr lines are collected by a thread."""

    def __init__(self, hook: str, *args):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPECBUILD_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, hook, *map(str, args)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, needle: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                pytest.fail(f"no {needle!r} on stderr within {timeout} s: {self.seen}")
            if line is None:
                pytest.fail(f"exited ({self.proc.wait()}) before {needle!r}: {self.seen}")
            self.seen.append(line)
            if needle in line:
                return

    def interrupt(self, signum: int = signal.SIGINT) -> tuple[int, list[str], float]:
        """Send `signum`; returns (exit code, stderr lines printed after it, seconds until exit)."""
        start = time.monotonic()
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running {EXIT_WITHIN_S} s after signal {signum}")
        elapsed = time.monotonic() - start
        after = []
        while (line := self.lines.get(timeout=10)) is not None:
            after.append(line)
        return code, [line for line in after if line.strip()], elapsed


def assert_interrupted(result, code: int, name: str) -> None:
    exit_code, lines, elapsed = result
    assert exit_code == code, (exit_code, lines)
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted ({name})"), lines
    assert elapsed < EXIT_WITHIN_S


def assert_nothing_left(parent: Path, keep=()) -> None:
    assert sorted(p.name for p in parent.iterdir()) == sorted(keep)


def build_args(ckpt: Path, out: Path, *extra):
    return ("build", "--checkpoint-dir", ckpt, "--output-dir", out, "--max-seq-len", 32, *extra)


# ---------------------------------------------------------------- build
@pytest.mark.parametrize("delay", [0.1, 0.3, 0.6, 1.0])
def test_build_sigint_early(tiny_checkpoints, tmp_path, delay):
    child = Child("none", *build_args(tiny_checkpoints[MODEL], tmp_path / "engine"))
    child.wait_for("@@ started")
    time.sleep(delay)  # inside the command: importing torch (its C++ start-up calls back into Python), the checkpoint
    assert_interrupted(child.interrupt(), 130, "SIGINT")
    assert_nothing_left(tmp_path)


def test_build_sigint_during_export(tiny_checkpoints, tmp_path):
    child = Child("none", *build_args(tiny_checkpoints[MODEL], tmp_path / "engine"))
    child.wait_for("exporting")
    time.sleep(0.5)
    result = child.interrupt()
    assert_interrupted(result, 130, "SIGINT")
    assert result[1][0].endswith("engine was not written"), result[1]
    assert_nothing_left(tmp_path)


@full("another signal: the fast tier interrupts an export with SIGINT")
def test_build_sigterm_during_export(tiny_checkpoints, tmp_path):
    child = Child("none", *build_args(tiny_checkpoints[MODEL], tmp_path / "engine"))
    child.wait_for("exporting")
    time.sleep(0.5)
    assert_interrupted(child.interrupt(signal.SIGTERM), 143, "SIGTERM")
    assert_nothing_left(tmp_path)


@full("two full builds, one interrupted")
def test_build_sigint_near_the_end_keeps_the_previous_engine(tiny_checkpoints, tmp_path):
    """--overwrite of a previous engine, interrupted after export and validation: the previous engine stays."""
    out = tmp_path / "engine"
    out.mkdir()
    (out / ef.ENGINE_MANIFEST).write_text(f"format: {ef.ENGINE_FORMAT}\nformat_version: 1\n")
    (out / ef.ENGINE_ONNX).write_bytes(b"previous")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    child = Child("sleep", *build_args(tiny_checkpoints[MODEL], out, "--overwrite"))
    child.wait_for("validated against torch")
    child.wait_for("@@ manifest")
    assert_interrupted(child.interrupt(), 130, "SIGINT")
    assert_nothing_left(tmp_path, keep=["engine"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ---------------------------------------------------------------- convert
def test_convert_sigint_with_the_weights_written(tiny_hf_models, tmp_path):
    child = Child("sleep", "convert", "--model-dir", tiny_hf_models[MODEL], "--output-dir", tmp_path / "a" / "ckpt")
    child.wait_for("@@ manifest")
    assert_interrupted(child.interrupt(), 130, "SIGINT")
    assert_nothing_left(tmp_path)  # also the parent directory "a" that convert created


def test_convert_interrupt_swallowed_in_a_weakref_callback_still_aborts(tiny_hf_models, tmp_path):
    child = Child("swallow", "convert", "--model-dir", tiny_hf_models[MODEL], "--output-dir", tmp_path / "ckpt")
    child.wait_for("@@ manifest")
    time.sleep(0.2)  # inside the callback
    assert_interrupted(child.interrupt(), 130, "SIGINT")  # one line: the ignored exception is not printed
    assert_nothing_left(tmp_path)


def test_convert_interrupt_swallowed_then_busy_is_raised_again(tiny_hf_models, tmp_path):
    child = Child("busy", "convert", "--model-dir", tiny_hf_models[MODEL], "--output-dir", tmp_path / "ckpt")
    child.wait_for("@@ manifest")
    assert_interrupted(child.interrupt(signal.SIGTERM), 143, "SIGTERM")
    assert_nothing_left(tmp_path)


def test_convert_file_size_limit_is_one_line(tiny_hf_models, tmp_path):
    out = tmp_path / "ckpt"
    child = Child("fsize=20000", "convert", "--model-dir", tiny_hf_models[MODEL], "--output-dir", out)
    assert child.proc.wait(120) == 1
    lines = _drain(child)
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [f"error: {out}: File too large"], lines
    assert_nothing_left(tmp_path)


def _drain(child: Child) -> list[str]:
    out = []
    while (line := child.lines.get(timeout=10)) is not None:
        out.append(line)
    return out


# ---------------------------------------------------------------- refused before any work (in-process)
def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def one_error_line(result, *needles) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_output_path_that_is_a_file(tiny_hf_models, tiny_checkpoints, tmp_path):
    target = tmp_path / "file"
    target.write_text("keep")
    one_error_line(invoke("convert", "--model-dir", tiny_hf_models[MODEL], "--output-dir", target), "not a directory")
    one_error_line(invoke(*build_args(tiny_checkpoints[MODEL], target, "--overwrite")), "not a directory")
    assert target.read_text() == "keep"


def test_overwrite_never_replaces_an_input(tiny_checkpoints, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints[MODEL], ckpt)
    before = sorted(p.name for p in ckpt.rglob("*"))
    one_error_line(invoke(*build_args(ckpt, ckpt, "--overwrite")), "is the input")
    one_error_line(invoke(*build_args(ckpt, tmp_path, "--overwrite")), "contains the input")
    one_error_line(invoke(*build_args(ckpt, ckpt / "engine")), "inside the input directory")
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("build:\n  max_seq_len: 32\n")
    (recipe.parent / ef.ENGINE_MANIFEST).write_text(f"format: {ef.ENGINE_FORMAT}\n")  # looks like an engine
    one_error_line(invoke(*build_args(ckpt, recipe.parent, "--recipe", recipe, "--overwrite")), "contains the input")
    assert sorted(p.name for p in ckpt.rglob("*")) == before and recipe.is_file()


def test_overwrite_refuses_a_directory_that_is_not_a_specbuild_output(tiny_checkpoints, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep")
    one_error_line(invoke(*build_args(tiny_checkpoints[MODEL], mine, "--overwrite")), "not a specbuild output")
    assert (mine / "thesis.tex").read_text() == "keep"


def test_read_only_parent(tiny_hf_models, tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    if os.geteuid() != 0:
        parent.chmod(0o555)
    else:  # root ignores the mode bits: make mkdir there fail as it would
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if Path(path).parent == parent:
                raise PermissionError(13, os.strerror(13), str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
    try:
        line = one_error_line(invoke("convert", "--model-dir", tiny_hf_models[MODEL], "--output-dir", parent / "c"))
        assert str(parent) in line and ("ermission denied" in line or "not writable" in line), line
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_os_error_escaping_a_command_is_one_line():
    import click

    from specbuild.cli.handling import handle_errors

    @click.command()
    @handle_errors
    def broken():
        open("/nonexistent-dir/x.json", "w")

    result = CliRunner().invoke(broken, [])
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: /nonexistent-dir/x.json: No such file or directory"
