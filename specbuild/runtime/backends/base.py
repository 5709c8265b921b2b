"""The backend interface (after polygraphy's runners): constructed the same way for every backend from an engine
directory, its manifest, the graph entry to run and a thread count; `run(feeds, aliases, buffers)` -> outputs by
name; `last_engine_s` = seconds spent inside the engine by the last call. Also the one reading of SPECBUILD_THREADS.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path

import numpy as np

from specbuild.errors import SpecbuildError

THREADS_VARIABLE = "SPECBUILD_THREADS"


def resolve_threads(threads: int | None = None) -> int:
    """Intra-op threads: `threads` (an integer >= 1), else SPECBUILD_THREADS, else 0 (the backend's default)."""
    if threads is None:
        env = os.environ.get(THREADS_VARIABLE, "").strip()
        if env and not env.isdigit():
            raise SpecbuildError(f"{THREADS_VARIABLE} must be an integer >= 0 (0 = default), got {env!r}")
        return int(env or 0)
    if not isinstance(threads, numbers.Integral) or isinstance(threads, bool) or threads < 1:
        raise SpecbuildError(f"--threads must be an integer >= 1, got {threads!r}")
    return int(threads)


class Backend:
    name = "base"
    last_engine_s: float = 0.0

    def __init__(self, engine_dir: Path, manifest: dict, graph: dict, threads: int = 0, shared_cores: bool = False):
        """graph: the engine.yaml `graphs` entry to run. threads: resolved (resolve_threads; 0 = default).
        shared_cores: another session runs in turns with this one (a draft model's and its target's): its threads
        must not busy-wait between calls."""
        self.engine_dir = Path(engine_dir)
        self.manifest = manifest
        self.graph = graph
        self.threads = threads
        self.shared_cores = shared_cores

    def run(self, feeds: dict, aliases: dict[str, str] | None = None, buffers: dict | None = None) -> dict:
        """feeds: the call's inputs. buffers: more inputs, long-lived (the KV cache): the same mapping object for
        as long as its buffers are the same, so that a backend may keep them bound. aliases: output name -> input
        name whose buffer the graph updates in place (bound, not copied)."""
        raise NotImplementedError

    def bind(self, array: np.ndarray):
        """Wrap a buffer fed on every call (the shared KV cache) the way this backend binds it best."""
        return array

    def graph_metadata(self) -> dict[str, str]:
        """Key/value entries the build recorded inside the graph file (none where the backend cannot read them)."""
        return {}

    def close(self) -> None:
        """Release what the backend holds (device memory, sessions)."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
