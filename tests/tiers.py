"""The test tiers: `scripts/test.sh` runs the fast tier (unit tests, tiny random models, each mode's lossless and
sampling tests on one tiny shape, the server and scheduler on tiny engines: under 5 minutes on 2 cores);
`scripts/test.sh --full` (CI) adds what is marked `full`: the real model, every shape and precision, Triton,
packaging, training."""

from __future__ import annotations

import pytest

# Test tiers. `scripts/test.sh` runs the fast tier (unit tests, tiny random models, each mode's lossless and sampling
# tests on one tiny shape, the server and scheduler on tiny engines: under 5 minutes on 2 cores); `scripts/test.sh
# --full` (CI) adds what is marked `full`: the real model, every shape and precision, Triton, packaging, training.
FULL = "full"


REAL_MODEL_FIXTURES = ("smollm2_", "gemma3_")  # fixtures of the real models: only tests of the full tier use them


def full(reason: str):
    """The `full` marker: this test runs in the full tier only, for `reason` (what makes it belong there)."""
    return getattr(pytest.mark, FULL)(reason)


def full_tier(config) -> bool:
    """Whether this run is the full tier (--full)."""
    return bool(config.getoption("--full"))


def fast_first(values, reason: str) -> list:
    """Parameter values for parametrize: the first runs in the fast tier, the others in the full tier (`reason`).
    A tuple is the values of several arguments (`parametrize("a,b", ...)`)."""
    values = list(values)
    rest = [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=full(reason)) for v in values[1:]]
    return values[:1] + rest


def select_tier(config, items) -> None:
    """Without --full, leave out the tests marked `full`; every `full` marker must say why."""
    kept, left = [], []
    for item in items:
        marker = item.get_closest_marker(FULL)
        if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0].strip()):
            raise pytest.UsageError(f"{item.nodeid}: a `full` marker must say why the test is in the full tier")
        if marker is None and any(name.startswith(REAL_MODEL_FIXTURES) for name in getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid}: a test of the real model belongs to the full tier (mark it full)")
        (left if marker is not None and not full_tier(config) else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
