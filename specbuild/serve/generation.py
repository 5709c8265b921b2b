"""One request through the scheduler for the HTTP layer: its token steps as they come (counted in the metrics), its
finish reason and usage, and its end recorded once, whether it finished, failed or was cancelled."""

from __future__ import annotations

import asyncio

from specbuild.serve.errors import APIError
from specbuild.serve.responses import usage

FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "max_seq_len": "length"}
_PENDING: set[asyncio.Task] = set()  # records waiting for a cancelled request's end (kept from garbage collection)


class Generation:
    """A submitted request (runtime Handle) seen from a route."""

    def __init__(self, state, handle):
        self.engine = state.engine
        self.metrics = state.metrics
        self.handle = handle
        self._steps_seen = 0
        self._recorded = False

    async def steps(self):
        """Wait for each engine step that gave this request tokens; raises the request's error (APIError)."""
        try:
            async for _ in self.handle.stream():
                self._steps_seen = self.metrics.steps(self.handle, self._steps_seen)
                yield
        except Exception as exc:  # noqa: BLE001 - the engine failed on this request
            self.record()
            raise APIError(500, f"generation failed: {exc}") from None
        self.record()
        if self.handle.stop_reason == "cancelled":
            raise APIError(503, "the request was cancelled: the server is shutting down")

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.handle.stop_reason)

    def result(self):
        return self.engine.result(self.handle)

    def usage(self, result) -> dict:
        """The usage of the finished request's GenerationResult."""
        return usage(result.prompt_tokens, len(result.output_ids), result.mean_accepted_tokens)

    def record(self) -> None:
        """The request's end in the metrics (once; call after it finished)."""
        if not self._recorded:
            self._recorded = True
            self._steps_seen = self.metrics.steps(self.handle, self._steps_seen)
            self.metrics.finished(self.handle, self.finish_reason)

    def abandon(self) -> None:
        """The client is gone: cancel the request (its slot frees at the next step) and record it once it ends."""
        if self.handle.finished:
            self.record()
            return
        self.handle.cancel()
        task = asyncio.get_running_loop().create_task(self._record_when_done())
        _PENDING.add(task)
        task.add_done_callback(_PENDING.discard)

    async def _record_when_done(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.handle.done.wait)
        self.record()
