"""Backend interface: run(feeds, aliases, buffers) -> outputs by name; last_engine_s = seconds spent inside the
engine."""

from __future__ import annotations


class Backend:
    name = "base"
    last_engine_s: float = 0.0

    def run(self, feeds: dict, aliases: dict[str, str] | None = None, buffers: dict | None = None) -> dict:
        """feeds: the call's inputs. buffers: more inputs, long-lived (the KV cache): the same mapping object for
        as long as its buffers are the same, so that a backend may keep them bound. aliases: output name -> input
        name whose buffer the graph updates in place (bound, not copied)."""
        raise NotImplementedError

    def graph_metadata(self) -> dict[str, str]:
        """Key/value entries the build recorded inside the graph file (none where the backend cannot read them)."""
        return {}
