"""Package boundaries (imports inside functions count): no mode package imports another mode package (what modes
share lives in a non-mode package such as specbuild.plugins.feature_draft); the builder never imports training; the
mode contract (specbuild.modes) sits below the implementations and imports neither them nor the builder or runtime:
builder, runtime, training, serve, the benchmarks and the CLI reach a mode only through the registry, and no mode
reaches into the build orchestrator. (tests/test_import_graph.py: no circles, no upward import between packages.)
"""

from specbuild.modes.registry import MODE_PACKAGES
from tests.test_import_graph import import_graph


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_mode_package_imports_another():
    graph = import_graph()
    crossings = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        for own in MODE_PACKAGES
        if _inside(module, own)
        for target in targets
        for other in MODE_PACKAGES
        if other != own and _inside(target, other)
    ]
    assert not crossings


def test_builder_does_not_import_training():
    graph = import_graph()
    crossings = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if _inside(module, "specbuild.builder")
        for target in targets
        if _inside(target, "specbuild.training")
    ]
    assert not crossings


def test_shared_draft_package_is_not_a_mode():
    assert "specbuild.plugins.feature_draft" not in MODE_PACKAGES
    graph = import_graph()
    shared = [m for m in graph if _inside(m, "specbuild.plugins.feature_draft")]
    assert shared and not [t for m in shared for t in graph[m] if any(_inside(t, p) for p in MODE_PACKAGES)]


LAYERS_BELOW_THE_MODES = tuple(
    f"specbuild.{name}" for name in ("builder", "runtime", "training", "serve", "bench", "cli")
)
ORCHESTRATOR = ("specbuild.builder.plan", "specbuild.builder.build")


def _mode_crossings(graph, importers, imported) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if any(_inside(module, p) for p in importers)
        for target in targets
        if any(_inside(target, p) for p in imported)
    ]


def test_builder_runtime_training_serve_bench_cli_import_no_mode_package():
    graph = import_graph()
    assert not _mode_crossings(graph, LAYERS_BELOW_THE_MODES, (*MODE_PACKAGES, "specbuild.plugins.feature_draft"))


def test_no_mode_package_imports_the_build_orchestrator():
    graph = import_graph()
    assert not _mode_crossings(graph, (*MODE_PACKAGES, "specbuild.plugins.feature_draft"), ORCHESTRATOR)


def test_the_mode_contract_imports_no_implementation_builder_or_runtime():
    """specbuild.modes declares (specs, registry, options): torch-free, it imports no mode, no builder, no runtime (the
    torch plugin base a mode's graph implements lives with the network: builder/network/mode_plugin.py)."""
    graph = import_graph()
    below = ("specbuild.plugins", "specbuild.builder", "specbuild.runtime")
    assert not _mode_crossings(graph, ("specbuild.modes",), below)


def test_the_boundary_check_sees_a_crossing():
    graph = {"specbuild.builder.x": {"specbuild.plugins.medusa.graph"}, "specbuild.plugins.medusa.graph": set()}
    assert _mode_crossings(graph, LAYERS_BELOW_THE_MODES, MODE_PACKAGES) == [
        "specbuild.builder.x -> specbuild.plugins.medusa.graph"
    ]
