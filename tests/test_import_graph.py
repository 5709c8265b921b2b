"""specbuild's modules import each other without circles, and its packages only downward through the layers below,
counting imports inside functions too."""

import ast
from pathlib import Path

import specbuild

ROOT = Path(specbuild.__file__).parent


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    graph[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(alias.name for alias in node.names)
        graph[name] = {t for t in graph[name] if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_detector_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert cycles(import_graph()) == []


# The packages from the bottom up: a module may import its own package and the layers below it, never one above. The
# foundation's modules (errors, formats, trees, files) import only each other; the mode contract only them.
LAYERS = (
    (
        "errors",
        "interrupts",
        "engine_format",
        "tree",
        "fsutil",
        "ports",
        "progress",
        "host_memory",
        "prompts",
        "task_prompts",
    ),
    ("modes",),
    ("runtime",),
    ("builder",),
    ("training",),
    ("plugins",),
    ("serve", "inspect", "bench"),
    ("cli",),
)


def layer_of(module: str) -> int | None:
    """The layer of a specbuild module by its top package (None: the package itself, specbuild/__init__.py)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next(i for i, names in enumerate(LAYERS) if parts[1] in names)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module in a higher layer (the package's own __init__ may import anything)."""
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(module) is not None and layer_of(target) is not None and layer_of(target) > layer_of(module)
    ]


def test_every_package_has_a_layer():
    packages = {m.split(".")[1] for m in import_graph() if m.count(".") >= 1}
    assert packages == {name for names in LAYERS for name in names}


def test_the_layer_check_sees_an_upward_import():
    graph = {"specbuild.modes.spec": {"specbuild.builder.plan"}, "specbuild.cli.run": {"specbuild.modes.spec"}}
    assert upward_imports(graph) == ["specbuild.modes.spec -> specbuild.builder.plan"]


def test_no_package_imports_upward():
    assert upward_imports(import_graph()) == []
