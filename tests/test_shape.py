"""The shape of the code, read from its syntax trees (fast, nothing imported):
- no step-graph I/O name (the string values engine_format.py declares for the graphs' inputs, outputs and states)
  is written as a string literal anywhere in specbuild/ but engine_format.py: code names them `ef.NAME`. A plugin's
  own declared names (e.g. eagle's DRAFT_KV) are not engine_format's and may be written where they are declared;
- the runtime (specbuild/runtime) and the server (specbuild/serve) import neither torch, the builder nor training,
  even inside functions (the runtime's import at run time is checked in tests/runtime/test_imports.py).
"""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath

import specbuild

ROOT = Path(specbuild.__file__).parent
ENGINE_FORMAT = ROOT / "engine_format.py"
IO_SECTION = "# Step-graph I/O"  # engine_format.py declares the graphs' I/O names from this line on
RUNTIME_MUST_NOT_IMPORT = ("torch", "specbuild.builder", "specbuild.training")
# Other things that happen to share a name with a graph input (files as path patterns, `*` within one folder): what
# the literal names there, in each case not the graph's I/O
HOMONYMS = {
    ("kv_cache", "specbuild/*.py"): "engine.yaml graphs[].kv_cache, the KV layout",
    ("kv_cache", "specbuild/builder/*.py"): "engine.yaml graphs[].kv_cache, the KV layout",
    ("kv_cache", "specbuild/builder/*/*.py"): "engine.yaml graphs[].kv_cache, the KV layout",
    ("kv_cache", "specbuild/runtime/*.py"): "engine.yaml graphs[].kv_cache, the KV layout",
    ("min_rows", "specbuild/runtime/exactness.py"): "a field of the exactness report (inspect, run --json)",
    ("min_rows", "specbuild/bench/sequential.py"): "a field of the exactness report (inspect, run --json)",
    ("top_k", "specbuild/plugins/*/*.py"): "a mode setting (engine.yaml mode.top_k: the draft tree's branching)",
    ("paths", "specbuild/plugins/redrafter/*.py"): "a key of the ReDrafter tree a beam merge returns",
    ("input_ids", "specbuild/training/*.py"): "the Hugging Face tokenizer's output key",
    ("temperature", "specbuild/training/*.py"): "a training recipe key",
    ("window", "specbuild/inspect.py"): "the sliding-window attention field of inspect's checkpoint report",
    ("window", "specbuild/plugins/lookahead/*.py"): "a lookahead setting (engine.yaml mode.drafter.window: W) and the "
    "name of its window-only n-gram pool",
    ("temperature", "specbuild/serve/*.py"): "an OpenAI request field",
    ("temperature", "specbuild/runtime/sampling.py"): "a SamplingParams field, named in its errors",
    ("top_p", "specbuild/runtime/sampling.py"): "a SamplingParams field, named in its errors",
    ("top_k", "specbuild/runtime/sampling.py"): "a SamplingParams field, named in its errors",
    ("top_p", "specbuild/serve/*.py"): "an OpenAI request field",
    ("top_k", "specbuild/serve/*.py"): "an OpenAI request field (an extension, as vLLM's)",
    ("temperature", "specbuild/bench/decoding.py"): "a peer's sampling setting (transformers, GenAI, OpenVINO)",
    ("top_k", "specbuild/bench/decoding.py"): "a peer's sampling setting (transformers, GenAI, OpenVINO)",
    ("top_p", "specbuild/bench/decoding.py"): "a peer's sampling setting (transformers, GenAI, OpenVINO)",
    ("top_k", "specbuild/bench/peers/*.py"): "a peer's sampling setting (llama.cpp's generate)",
    ("top_p", "specbuild/bench/peers/*.py"): "a peer's sampling setting (llama.cpp's generate)",
    ("temperature", "specbuild/cli/options.py"): "a SamplingParams field, named by its flag in errors",
    ("top_k", "specbuild/cli/options.py"): "a SamplingParams field, named by its flag in errors",
    ("top_p", "specbuild/cli/options.py"): "a SamplingParams field, named by its flag in errors",
}


def io_names() -> set[str]:
    """Every string constant engine_format.py declares from its I/O section on; for a template ("past_key_{}") its
    fixed part too (what an f-string would hold)."""
    source = ENGINE_FORMAT.read_text()
    first_line = next(i for i, line in enumerate(source.splitlines(), 1) if line.startswith(IO_SECTION))
    names = set()
    for node in ast.parse(source).body:
        if node.lineno < first_line or not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            names.add(value.value)
            if value.value.endswith("{}"):
                names.add(value.value.removesuffix("{}"))
    return names


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def string_literals(path: Path):
    """(line, value) of every str constant in the file that is not a docstring (f-string parts included)."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value


def imported_modules(path: Path):
    """(line, module) of every import in the file, inside functions too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def test_io_names_are_found_in_engine_format():
    names = io_names()
    assert {"input_ids", "next_tree_mask", "new_state_", "state_", "past_key_", "past_key_{}"} <= names
    assert "engine.yaml" not in names and "onnxruntime" not in names  # file and backend names are not graph I/O


def homonym(value: str, file: str) -> bool:
    path = PurePosixPath(file)
    return any(name == value and path.match(pattern) for name, pattern in HOMONYMS)


def test_no_step_graph_io_name_is_a_string_literal_outside_engine_format():
    names = io_names()
    offenders = [
        f"{file}:{line}: {value!r}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != ENGINE_FORMAT
        for file in [path.relative_to(ROOT.parent).as_posix()]
        for line, value in string_literals(path)
        if value in names and not homonym(value, file)
    ]
    assert offenders == [], "use the engine_format constants (ef.NAME):\n" + "\n".join(offenders)


def test_the_runtime_and_the_server_import_neither_torch_nor_the_builder_nor_training():
    offenders = [
        f"{path.relative_to(ROOT.parent)}:{line}: import {module}"
        for path in sorted([*(ROOT / "runtime").rglob("*.py"), *(ROOT / "serve").rglob("*.py")])
        for line, module in imported_modules(path)
        if any(module == bad or module.startswith(bad + ".") for bad in RUNTIME_MUST_NOT_IMPORT)
    ]
    assert offenders == []
