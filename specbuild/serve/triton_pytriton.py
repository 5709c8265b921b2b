"""`specbuild serve --triton`: the engine's scheduler bound into Triton Inference Server with PyTriton (extra
`specbuild[triton]`), as one decoupled streaming model: Triton's gRPC stream (`ModelStreamInfer`) and
`POST /v2/models/<name>/generate_stream` reach it; inputs and responses in triton_io.py.

The engine loads before Triton starts (a failure is one line and exit 1). Each request is an async generator on
PyTriton's event loop, so requests are served concurrently and batched by the scheduler; a bad request gets its
error (the message names the input) and the server goes on. SIGINT/SIGTERM stop Triton (PyTriton's handler), then
the requests still in flight are cancelled and the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.serve import triton_io
from specbuild.serve.errors import APIError
from specbuild.serve.generation import Generation
from specbuild.serve.server import check_options
from specbuild.serve.state import ServerState


class RequestError(Exception):
    """A request's error as its client sees it: PyTriton sends the traceback of an error raised by the infer
    callable, and this one has none, so the client gets one line (`...RequestError: <message>`)."""

    @property
    def __traceback__(self):
        return None

    @__traceback__.setter
    def __traceback__(self, _value):
        pass


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class TritonModel:
    """The infer callable PyTriton binds: one request at a time per call (batching is the scheduler's)."""

    def __init__(self, state):
        self.state = state
        self._executor = None

    async def infer(self, requests):
        if self._executor is None:  # each stream waits for its tokens in a thread of the loop's default executor
            self._executor = ThreadPoolExecutor(2 * (self.state.slots + self.state.max_queue) + 8, "specbuild-triton")
            asyncio.get_running_loop().set_default_executor(self._executor)
        for request in requests:  # the model is bound without Triton batching: one request per call
            async for response in self._stream(request):
                yield [response]

    async def _stream(self, request):
        state = self.state
        try:
            wanted = triton_io.parse_inputs(dict(request.data), state.engine, state.model_name)
            handle = state.submit(wanted.request())
        except APIError as exc:
            state.metrics.error(exc.status)
            raise RequestError(exc.message) from None
        generation = Generation(state, handle)
        responses = triton_io.Responses(state.engine, handle)
        try:
            async for _ in generation.steps():
                yield responses.step()
            yield responses.last()
        except APIError as exc:
            raise RequestError(exc.message) from None
        finally:
            generation.abandon()  # cancels it unless it finished (the client went away)


def tensors(specs):
    import numpy as np
    from pytriton.model_config import Tensor

    return [Tensor(name=s.name, dtype=bytes if s.dtype is np.object_ else s.dtype, shape=s.shape, optional=s.optional)
            for s in specs]  # fmt: skip


def run_triton(
    engine_dir: Path, host: str, http_port: int, grpc_port: int, metrics_port: int, threads: int | None,
    max_queue: int, max_batch_size: int | None, model_name: str | None, allow_lossy: bool,
) -> None:  # fmt: skip
    """Load the engine, bind it into PyTriton's Triton server and serve until SIGINT/SIGTERM (the options are
    checked first, one line each, as `specbuild serve` checks them)."""
    from pytriton.model_config import ModelConfig
    from pytriton.triton import Triton, TritonConfig

    for flag, value in (("--grpc-port", grpc_port), ("--metrics-port", metrics_port)):
        if not 1 <= value <= 65535:
            raise SpecbuildError(f"{flag} must be in [1, 65535], got {value}")
    check_options(engine_dir, http_port, max_queue, max_batch_size)
    name = triton_io.check_model_name(model_name or Path(engine_dir).resolve().name)
    state = ServerState(engine_dir, name, dict(threads=threads, allow_lossy=allow_lossy), max_batch_size, max_queue)
    _python_library_path()
    if not state.load():
        raise SpecbuildError(f"{state.engine_dir}: the engine failed to load: {state.failure}")
    config = TritonConfig(
        http_address=host, http_port=http_port, grpc_address=host, grpc_port=grpc_port, metrics_port=metrics_port,
        exit_timeout_secs=5,
    )  # fmt: skip
    model = TritonModel(state)
    try:
        with Triton(config=config) as triton:
            triton.bind(
                model_name=state.model_name,
                infer_func=model.infer,
                inputs=tensors(triton_io.INPUTS),
                outputs=tensors(triton_io.OUTPUTS),
                config=ModelConfig(batching=False, decoupled=True),
                strict=True,
            )
            engine = state.engine
            log(
                f"specbuild serve --triton: ready: engine {state.engine_dir} as model '{state.model_name}' (mode "
                f"{engine.manifest['speculative_mode']}, {'lossless' if engine.lossless else 'LOSSY'}, max_batch_size "
                f"{state.slots}, max_seq_len {engine.max_seq_len}, threads {engine.threads}); Triton HTTP "
                f"http://{host}:{http_port}/v2/models/{state.model_name}/generate_stream, gRPC {host}:{grpc_port}"
            )
            with _stop_on_signals():
                triton.serve()  # returns on the KeyboardInterrupt a signal raises (PyTriton then stops Triton)
    finally:
        state.drain(grace_s=0)
        log("specbuild serve --triton: stopped")


def _python_library_path() -> None:
    """Triton's Python backend stub links this interpreter's libpython: its directory goes on LD_LIBRARY_PATH (the
    server PyTriton starts inherits it), needed where Python is not the system's."""
    libdir = sysconfig.get_config_var("LIBDIR")
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if libdir and libdir not in paths:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([*paths, libdir])


@contextlib.contextmanager
def _stop_on_signals():
    """SIGINT and SIGTERM end serving (a KeyboardInterrupt, which Triton.serve() takes as its stop): the process then
    drains and exits 0, as `specbuild serve` does."""

    def stop(signum, _frame):
        log(f"specbuild serve --triton: {signal.Signals(signum).name}: stopping")
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
