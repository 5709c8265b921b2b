"""Backend interface: run(feeds, aliases) -> outputs by name; last_engine_s = seconds spent inside the engine."""

from __future__ import annotations

import numpy as np


class Backend:
    name = "base"
    last_engine_s: float = 0.0

    def run(self, feeds: dict[str, np.ndarray], aliases: dict[str, str] | None = None) -> dict[str, np.ndarray]:
        """aliases: output name -> input name whose buffer the graph updates in place (bound, not copied)."""
        raise NotImplementedError
