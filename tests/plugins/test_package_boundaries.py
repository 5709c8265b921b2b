"""Package boundaries (imports inside functions count): no mode package imports another mode package (what modes
share lives in a non-mode package such as specbuild.plugins.feature_draft), and the builder never imports training.
"""

from specbuild.plugins.registry import MODE_PACKAGES
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
