"""The build's shape: resolve checks everything once before any work, export never asks which graph module it has,
and builder/ reads a mode's options only through the mode's declarations."""

import ast
from pathlib import Path

import pytest

import specbuild.builder as builder_package
from specbuild import engine_format as ef
from specbuild.builder import plan as plan_module
from specbuild.builder.build import build_plan
from specbuild.builder.options import BuildOptions
from specbuild.modes.registry import mode_options
from tests.helpers import quiet
from tests.tiers import full

BUILDER = Path(builder_package.__file__).parent
GRAPH_MODULES = {"StepModule", "FusedStepModule", "PortableGraph", "FusedGraph", "GraphKind"}


def _names(node) -> set[str]:
    nodes = [n for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))]
    return {n.id if isinstance(n, ast.Name) else n.attr for n in nodes}


@pytest.mark.parametrize("file", ["export/exporter.py", "graphs.py", "build.py"])
def test_no_isinstance_on_graph_modules(file):
    tree = ast.parse((BUILDER / file).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "isinstance"]
    assert not [ast.unparse(c) for c in calls if _names(c.args[1]) & GRAPH_MODULES]


def test_builder_reads_no_mode_option_by_name():
    """A mode's options reach builder/ through its plugin (check_options, typical_acceptance) and ModeSpec.options,
    never as `options.<name>` or getattr(options, "<name>") there."""
    options = set(mode_options())

    def is_options(node) -> bool:
        return getattr(node, "id", None) == "options" or getattr(node, "attr", None) == "options"

    found = []
    for path in BUILDER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and is_options(node.value) and node.attr in options:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and is_options(node.args[0]):
                if isinstance(node.args[1], ast.Constant) and node.args[1].value in options:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found


@full("another build (resolve's checks, counted)")
def test_every_check_runs_once_in_resolve(tiny_checkpoints, tmp_path, monkeypatch):
    plan = plan_module.resolve(
        tiny_checkpoints["qwen2_bias"], tmp_path / "engine", BuildOptions(backends=(ef.BACKEND_ONNXRUNTIME,))
    )

    def again(*args, **kwargs):
        raise AssertionError("checked again after resolve")

    monkeypatch.setattr(BuildOptions, "check", again)
    monkeypatch.setattr(plan.plugin_cls, "check_options", again)
    monkeypatch.setattr(plan_module, "prepare_output_dir", again)
    monkeypatch.setattr("specbuild.builder.checkpoint.tokenizer_io.validate_tokenizer", again)
    engine_dir = build_plan(plan, log=quiet)
    assert (engine_dir / ef.ENGINE_MANIFEST).is_file()


@full("another build (the registry's one lookup)")
def test_the_mode_is_looked_up_once_per_build(tiny_checkpoints, tmp_path, monkeypatch):
    """resolve looks the ModeSpec up once and the plan carries it: nothing after asks the registry again."""
    from specbuild.modes import registry

    calls = []
    real = registry.get_mode
    monkeypatch.setattr(registry, "get_mode", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(plan_module, "get_mode", registry.get_mode)
    options = BuildOptions(backends=(ef.BACKEND_ONNXRUNTIME,), speculative_mode="ngram", num_draft_tokens=2)
    build_plan(plan_module.resolve(tiny_checkpoints["qwen2_bias"], tmp_path / "engine", options), log=quiet)
    assert calls == [("ngram",)]
