"""The test session: one thread per xdist worker, a user cache of its own, the speculation policy pinned, the tiers
(tests/tiers.py), one trace cache for the run, and xdist groups kept on one worker. The shared fixtures live by concern
in tests/fixtures/ (tiny models, real models), the shapes in tests/shapes.py, the helpers in tests/helpers.py."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch

from specbuild.builder.export.trace_cache import CACHE_ENV as TRACE_CACHE_ENV
from tests.fixtures.real import (  # noqa: F401 - session fixtures, visible to every test
    gemma3_checkpoint,
    gemma3_hf,
    smollm2_checkpoint,
    smollm2_engines,
    smollm2_greedy,
    smollm2_hf,
    smollm2_hf_model,
)
from tests.fixtures.tiny import int8_engines, tiny_checkpoints, tiny_engines, tiny_hf_models  # noqa: F401
from tests.tiers import FULL, select_tier

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per xdist worker: two workers on two cores, no oversubscription (ORT reads SPECBUILD_THREADS)
    os.environ.setdefault("SPECBUILD_THREADS", "1")
    torch.set_num_threads(1)


# the user cache (row-invariance verdicts, verified file hashes) of this test process only: nothing is read from or
# left in the user's ~/.cache; tests that need a cold or warm cache set it themselves
# exactness tests must exercise drafting whatever the machine's measured costs: the policy is pinned (tests of the
# cost-driven policy pass theirs explicitly)
os.environ.setdefault("SPECBUILD_SPECULATION", "always")
if "SPECBUILD_CACHE_DIR" not in os.environ:
    os.environ["SPECBUILD_CACHE_DIR"] = tempfile.mkdtemp(prefix="specbuild-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPECBUILD_CACHE_DIR"], True)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="Also run the full tier (tests marked `full`).")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{FULL}(reason): in the full tier only (scripts/test.sh --full); says why")
    # one trace cache for the run (builder/export/trace_cache.py): the builds of a structure after its first, in any
    # worker or CLI subprocess, skip torch.export (tests/builder/export/test_trace_cache.py proves them byte-identical)
    if not hasattr(config, "workerinput") and TRACE_CACHE_ENV not in os.environ:
        config._trace_cache_dir = tempfile.mkdtemp(prefix="specbuild-trace-cache-")
        os.environ[TRACE_CACHE_ENV] = config._trace_cache_dir


def pytest_unconfigure(config):
    folder = getattr(config, "_trace_cache_dir", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(TRACE_CACHE_ENV, None)


def pytest_collection_modifyitems(config, items):
    """Select the tier, then keep each `xdist_group` on one worker (its session fixtures are then built once).

    pytest-xdist 3.8 tags grouped items by assigning `item._nodeid`, which pytest >= 9.2 no longer reads (node ids
    live in `item._id`): the groups were silently spread over both workers and every expensive fixture was built
    twice. Tag them here the way xdist's scheduler reads them (`<nodeid>@<group>`), on any pytest version."""
    select_tier(config, items)
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        groups = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if not groups or "@" in item.nodeid:
            continue
        tagged = f"{item.nodeid}@{'_'.join(groups)}"
        if hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(tagged)
        else:
            item._nodeid = tagged
