"""`specbuild serve`: the app on uvicorn. The engine loads in the background while the port already answers (503);
a startup line then gives the address, the engine, its mode and limits. SIGINT/SIGTERM: new requests get 503,
those in flight have GRACE_S seconds to finish and are then cancelled; the process exits 0 within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import ssl
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn

from specbuild.errors import SpecbuildError
from specbuild.runtime.manifest import load_manifest
from specbuild.serve.app import create_app
from specbuild.serve.state import ServerState

GRACE_S = 1.5  # in-flight requests may finish for this long after a shutdown signal, then are cancelled
SHUTDOWN_S = GRACE_S + 2.5  # uvicorn cancels the handlers still running after this long


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Server(uvicorn.Server):
    """uvicorn with the scheduler drained on the first signal, and no signal re-raised after the shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if not self.state.draining:
            log(f"specbuild serve: {signal.Signals(sig).name}: stopping (requests in flight get {GRACE_S:g} s)")
            self.state.drain_in_background(GRACE_S)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


@dataclasses.dataclass(frozen=True)
class Exposure:
    """Who may reach the server and how: API keys (access.py; none: open) and TLS (uvicorn's certificate options)."""

    api_keys: tuple[str, ...] = ()
    protect_metrics: bool = False
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    shared_draft_pool: bool = False  # every key's requests learn from one pool (access.py: tenants)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def check(self, host: str) -> None:
        """One-line errors for what cannot work (a private key without its certificate, a certificate that does not
        load, --protect-metrics without a key); a warning where keys would travel in clear beyond this machine."""
        if self.ssl_keyfile and not self.ssl_certfile:
            raise SpecbuildError("--ssl-keyfile needs --ssl-certfile (the certificate it is the key of)")
        if self.ssl_certfile:
            try:
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            except (OSError, ssl.SSLError) as exc:
                what = f"--ssl-certfile {self.ssl_certfile}"
                what += f" / --ssl-keyfile {self.ssl_keyfile}" if self.ssl_keyfile else ""
                raise SpecbuildError(f"{what}: cannot load the certificate and its key: {exc}") from None
        if self.protect_metrics and not self.api_keys:
            raise SpecbuildError("--protect-metrics needs an API key (--api-key, SPECBUILD_API_KEY or --api-key-file)")
        if self.api_keys and not self.ssl_certfile and host not in ("127.0.0.1", "localhost", "::1"):
            log(f"specbuild serve: warning: API keys travel in clear text over http to {host}; give --ssl-certfile "
                "or keep the server behind a TLS proxy")  # fmt: skip

    def uvicorn_options(self) -> dict:
        if not self.ssl_certfile:
            return {}
        keyfile = str(self.ssl_keyfile) if self.ssl_keyfile else None
        return {"ssl_certfile": str(self.ssl_certfile), "ssl_keyfile": keyfile}


def run_server(
    engine_dir: Path,
    host: str,
    port: int,
    threads: int | None,
    max_queue: int,
    max_batch_size: int | None,
    model_name: str | None,
    allow_lossy: bool,
    exposure: Exposure = Exposure(),
    draft_pool: Path | None = None,
) -> None:
    """Serve an engine directory until SIGINT/SIGTERM."""
    limits = check_options(engine_dir, port, max_queue, max_batch_size)
    exposure.check(host)
    slots = max_batch_size or limits["max_batch_size"]
    state = ServerState(
        engine_dir,
        model_name or Path(engine_dir).resolve().name,
        dict(threads=threads, allow_lossy=allow_lossy, draft_pool=draft_pool),
        max_batch_size,
        max_queue,
    )
    address = f"{exposure.scheme}://{host}:{port}"

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # each streamed or awaited request waits for its tokens in a thread of the default executor
        workers = 2 * (slots + max_queue) + 8
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(workers, "specbuild-serve"))
        threading.Thread(target=_load, args=(state, address), name="specbuild-load", daemon=True).start()
        yield
        state.drain(grace_s=0)

    config = uvicorn.Config(
        create_app(state, lifespan, exposure.api_keys, exposure.protect_metrics, exposure.shared_draft_pool),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_S,
        **exposure.uvicorn_options(),
    )
    if exposure.api_keys:
        open_routes = "/health" if exposure.protect_metrics else "/health and /metrics"
        log(f"specbuild serve: {len(exposure.api_keys)} API key(s): every route but {open_routes} needs "
            "'Authorization: Bearer KEY'")  # fmt: skip
    log(f"specbuild serve: loading {engine_dir} (listening on {address}; /health answers 503 until it is ready)")
    _Server(config, state).run()
    log("specbuild serve: stopped")


def check_options(engine_dir: Path, port: int, max_queue: int, max_batch_size: int | None) -> dict:
    """Fail at once (one line) on what can be checked before the engine loads; returns the engine's limits."""
    if not 1 <= port <= 65535:
        raise SpecbuildError(f"--port must be in [1, 65535], got {port}")
    if max_queue < 0:
        raise SpecbuildError(f"--max-queue must be an integer >= 0, got {max_queue}")
    limits = load_manifest(engine_dir)["limits"]
    if max_batch_size is not None and not 1 <= max_batch_size <= limits["max_batch_size"]:
        raise SpecbuildError(
            f"--max-batch-size {max_batch_size} is outside [1, {limits['max_batch_size']}] (the engine's KV slots)"
        )
    return limits


def _load(state: ServerState, address: str) -> None:
    if not state.load():
        log(f"error: {state.engine_dir}: the engine failed to load: {state.failure} (/health answers 503)")
        return
    engine = state.engine
    log(
        f"specbuild serve: ready on {address}: engine {state.engine_dir} as model '{state.model_name}' (mode "
        f"{engine.manifest['speculative_mode']}, {'lossless' if engine.lossless else 'LOSSY'}, max_batch_size "
        f"{state.slots}, max_seq_len {engine.max_seq_len}, max queue {state.max_queue}, threads {engine.threads}); "
        f"OpenAI API at {address}/v1, /health, /metrics"
    )
