"""The base install runs engines without the build stack: a wheel of this tree, installed without extras into a
clean venv, runs and inspects an engine built here, has no torch, and `specbuild build` there names the extra it
needs. Also what the CLI says when an extra is missing, in process.

Slow-ish (a wheel build and a pip install of the runtime's dependencies, from pip's cache when warm, while a tiny
engine builds): about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbuild.cli import extras
from specbuild.cli.main import cli
from tests.helpers import write_char_tokenizer
from tests.shapes import save_tiny_model
from tests.tiers import full

pytestmark = [pytest.mark.xdist_group("packaging"), full("packaging: builds a wheel and installs it into a fresh venv")]

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama_gqa_llama3rope"  # vocab 97: the character tokenizer's ids 0..95 fit
PACKAGE_FILES = ("setup.py", "pyproject.toml", "specbuild")
BUILD_STACK = ("torch", "transformers", "onnxscript", "safetensors", "accelerate", "gguf")


def _run(args, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _base_install(tmp_path: Path) -> Path:
    """A clean venv with this tree's wheel installed without extras; returns its bin directory."""
    source, wheels, venv = tmp_path / "source", tmp_path / "wheels", tmp_path / "venv"
    source.mkdir()
    for name in PACKAGE_FILES:  # a copy: building in place would leave build/ and *.egg-info in the checkout
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, source], tmp_path)
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)  # this venv's pip installs into it
    (wheel,) = wheels.glob("specbuild-*.whl")
    _run([*pip, "--python", venv / "bin" / "python", "install", "-q", "--no-compile", wheel], tmp_path)
    return venv / "bin"


def _tiny_engine(tmp_path: Path) -> tuple[Path, list[int]]:
    """A tiny `none` engine with a tokenizer and a chat template, and its greedy tokens for 5,17,42 here."""
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.checkpoint.convert import convert_checkpoint
    from specbuild.runtime.engine import Engine

    hf = save_tiny_model(MODEL, tmp_path / "hf")
    write_char_tokenizer(hf)
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", progress=False)
    engine = build_engine(
        ckpt, tmp_path / "engine", BuildOptions(max_seq_len=64, backends="onnxruntime"), log=lambda *_: None
    )
    return engine, Engine(engine).generate(input_ids=[5, 17, 42], max_new_tokens=6).output_ids


def test_base_install_runs_and_inspects_without_torch(tmp_path):
    with ThreadPoolExecutor(1) as pool:  # pip (mostly waiting on the index) works while the engine builds
        installing = pool.submit(_base_install, tmp_path)
        engine, want = _tiny_engine(tmp_path)
        bin_dir = installing.result()
    specbuild, python = bin_dir / "specbuild", bin_dir / "python"

    probe = f"import importlib.util as u; print([m for m in {BUILD_STACK!r} if u.find_spec(m)])"
    assert _run([python, "-c", probe], tmp_path).stdout.strip() == "[]"
    kernel_source = (
        "import importlib.resources as r; s = r.files('specbuild.runtime.kernels') / 'src'; "
        "print(sorted(p.name for p in s.iterdir()))"
    )
    shipped = _run([python, "-c", kernel_source], tmp_path).stdout.strip()  # built on the user's machine
    assert shipped == str(sorted(p.name for p in (ROOT / "specbuild/runtime/kernels/src").iterdir()))

    ran = _run(
        [specbuild, "run", "--engine-dir", engine, "--input-ids", "5,17,42", "--max-new-tokens", 6, "--json"], tmp_path
    )
    assert json.loads(ran.stdout)["output_ids"] == want
    chat = _run([specbuild, "run", "--engine-dir", engine, "--prompt", "hi", "--chat", "--max-new-tokens", 3], tmp_path)
    assert "tok/s" in chat.stderr

    inspected = json.loads(_run([specbuild, "inspect", engine, "--json", "--verify"], tmp_path).stdout)
    assert inspected["speculative_mode"] == "none"

    refused = _run(
        [specbuild, "build", "--checkpoint-dir", tmp_path / "ckpt", "--output-dir", tmp_path / "e2"],
        tmp_path,
        check=False,
    )
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: specbuild build needs the build extra (torch, transformers, onnxscript, safetensors not installed): "
        "pip install 'specbuild[build]'"
    ]
    assert not (tmp_path / "e2").exists()


@pytest.mark.parametrize(
    "args, extra",
    [
        (["build", "--checkpoint-dir", "c", "--output-dir", "e"], "build"),
        (["convert", "--model-dir", "m", "--output-dir", "c"], "build"),
        (["demo"], "build"),
        (["prepare-default-model"], "build"),
        (["train", "--recipe", __file__], "train"),
        (["serve", "--engine-dir", "e"], "serve"),
        (["serve", "--triton", "--engine-dir", "e"], "triton"),
        (["triton-repo", "--engine-dir", "e", "--output-dir", "r"], "serve"),
    ],
)
def test_a_command_names_its_missing_extra(monkeypatch, tmp_path, args, extra):
    monkeypatch.setitem(extras.EXTRA_MODULES, extra, ("no_such_module_specbuild",))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert res.exit_code == 1, res.output
    assert res.stderr.strip().splitlines() == [
        f"error: specbuild {'serve --triton' if '--triton' in args else args[0]} needs the {extra} extra "
        "(no_such_module_specbuild not installed): "
        f"pip install 'specbuild[{extra}]'"
    ]
    assert list(tmp_path.iterdir()) == []
