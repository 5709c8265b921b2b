"""The server's engine and scheduler: loaded in the background (health answers 503 meanwhile), a bounded queue,
and draining on shutdown (refuse new requests, let those in flight finish for a grace period, cancel the rest)."""

from __future__ import annotations

import threading
from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.runtime.scheduler import Handle, Request, Scheduler
from specbuild.serve.errors import APIError
from specbuild.serve.metrics import Metrics


class ServerState:
    """What every route reads: the engine once loaded, the scheduler, the limits, the metrics."""

    def __init__(self, engine_dir: Path, model_name: str, engine_options: dict, max_batch_size, max_queue: int):
        self.engine_dir = engine_dir
        self.model_name = model_name
        self.engine_options = engine_options  # Engine(**): threads, allow_lossy
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.engine = None
        self.scheduler: Scheduler | None = None
        self.failure: str | None = None
        self.draining = False
        self.metrics = Metrics(
            running=lambda: self._count("active"),
            waiting=lambda: self._count("waiting"),
            learnt=self._learnt_memory,
            kv=self._kv_memory,
        )

    def _count(self, what: str) -> int:
        return getattr(self.scheduler, what) if self.scheduler is not None else 0

    def _learnt_memory(self) -> tuple[int, int]:
        return self.engine.learnt_memory() if self.engine is not None else (0, 0)

    def _kv_memory(self) -> tuple[int, int]:
        return self.scheduler.kv_memory() if self.scheduler is not None else (0, 0)

    def load(self) -> bool:
        """Load the engine and start its scheduler thread (run in a background thread); False: `failure` says why."""
        from specbuild.runtime.engine import Engine

        try:
            engine = Engine(self.engine_dir, **self.engine_options)
            engine.codec  # noqa: B018 - a server needs the tokenizer: fail at load, not at the first request
            scheduler = Scheduler(engine, max_batch_size=self.max_batch_size, speculation=engine.speculation)
        except Exception as exc:  # noqa: BLE001 - whatever stops the load, /health reports it
            self.failure = str(exc) or type(exc).__name__
            return False
        self.engine = engine
        self.scheduler = scheduler.start()
        return True

    def check_ready(self) -> None:
        """An APIError (503) unless the server takes requests now."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.failure is not None:
            raise APIError(503, f"the engine failed to load: {self.failure}")
        if self.scheduler is None:
            raise APIError(503, "Loading model")
        if not self.scheduler.running_in_background:
            raise APIError(503, "the engine's scheduler has stopped")

    @property
    def slots(self) -> int:
        return self.scheduler.batch.slots

    def submit(self, request: Request) -> Handle:
        """Queue a request: 429 when `max_queue` requests already wait beyond the slots."""
        self.check_ready()
        scheduler = self.scheduler
        if scheduler.active + scheduler.waiting >= self.slots + self.max_queue:
            raise APIError(
                429,
                f"the server is busy: {scheduler.active} requests running and {scheduler.waiting} waiting "
                f"(--max-queue {self.max_queue}); retry later",
            )
        try:
            return scheduler.submit(request)
        except SpecbuildError as exc:  # stopping (a shutdown began between the checks)
            raise APIError(503, str(exc)) from None

    def drain(self, grace_s: float, cancel_timeout_s: float = 2.0) -> None:
        """Refuse new requests; let those in flight finish for `grace_s` seconds, then cancel the rest."""
        self.draining = True
        if self.scheduler is not None:
            self.scheduler.stop(timeout=grace_s)
            self.scheduler.stop(cancel=True, timeout=cancel_timeout_s)

    def drain_in_background(self, grace_s: float) -> None:
        threading.Thread(target=self.drain, args=(grace_s,), name="specbuild-drain", daemon=True).start()
