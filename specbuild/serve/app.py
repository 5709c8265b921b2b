"""The Starlette app: /health, /metrics, /v1/models, /v1/completions and /v1/chat/completions.

Every refusal is an OpenAI-style error (errors.py) and leaves the server serving. A non-streamed request whose
client disconnects is cancelled (its slot frees at the next step); streamed ones are cancelled by streaming.py.
"""

from __future__ import annotations

import asyncio
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specbuild.serve import json_text, streaming
from specbuild.serve.access import APIKeyMiddleware
from specbuild.serve.errors import APIError
from specbuild.serve.generation import Generation
from specbuild.serve.openai_schema import parse_chat, parse_completion
from specbuild.serve.responses import Responses

MAX_BODY_BYTES = 1 << 20
DRAIN_BYTES = 16 << 20  # an oversized body is read (and dropped) up to this, to answer its 413


def create_app(
    state, lifespan=None, api_keys=(), protect_metrics: bool = False, shared_draft_pool: bool = False
) -> Starlette:
    """The app over a ServerState (state.py); lifespan: Starlette's startup/shutdown context; api_keys: the keys a
    client must send (none: open), /metrics among the closed routes where protect_metrics (access.py); each key's
    requests are their own tenant unless shared_draft_pool."""
    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, Exception: internal_error}
    refused = state.metrics.error
    access = Middleware(
        APIKeyMiddleware,
        keys=api_keys,
        protect_metrics=protect_metrics,
        on_refusal=refused,
        tenants=not shared_draft_pool,
    )
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan, middleware=[access])
    app.state.server = state
    return app


async def health(request: HTTPRequest) -> Response:
    try:
        request.app.state.server.check_ready()
    except APIError as exc:
        return exc.response()
    return JSONResponse({"status": "ok"})


async def metrics(request: HTTPRequest) -> Response:
    state_metrics = request.app.state.server.metrics
    return Response(state_metrics.exposition(), media_type=state_metrics.content_type)


async def models(request: HTTPRequest) -> Response:
    state = request.app.state.server
    state.check_ready()
    card = {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "specbuild"}
    card["max_model_len"] = state.engine.max_seq_len
    return JSONResponse({"object": "list", "data": [card]})


async def completions(request: HTTPRequest) -> Response:
    return await _generate(request, parse_completion)


async def chat_completions(request: HTTPRequest) -> Response:
    return await _generate(request, parse_chat)


async def _generate(request: HTTPRequest, parse) -> Response:
    state = request.app.state.server
    state.check_ready()
    wanted = parse(await _json_body(request), state.engine, state.model_name)
    handle = state.submit(wanted.request(request.scope.get("state", {}).get("tenant")))
    generation = Generation(state, handle)
    responses = Responses(wanted.chat, state.model_name)
    if wanted.stream:
        stream = streaming.events(generation, responses, wanted.include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers=streaming.SSE_HEADERS)
    finished = asyncio.ensure_future(_run(generation))
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not finished.done():
        generation.abandon()
        finished.cancel()
        return Response(status_code=499)  # nobody reads it: the client has gone
    finished.result()  # raises the request's APIError
    result = generation.result()
    return JSONResponse(responses.complete(result.text or "", generation.finish_reason, generation.usage(result)))


async def _run(generation: Generation) -> None:
    async for _ in generation.steps():
        pass


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: HTTPRequest):
    """The JSON body: at most MAX_BODY_BYTES (413 beyond: the rest is read and dropped first, up to DRAIN_BYTES, so
    that a client still sending reads the answer instead of a reset connection); json_text.py refuses (400) what
    is not JSON, nested too deep, or holds a string UTF-8 cannot hold."""
    declared = request.headers.get("content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES
    if too_large and int(declared) > DRAIN_BYTES:
        raise _too_large()  # not worth reading: the connection closes under the client
    body, read = bytearray(), 0
    async for chunk in request.stream():
        read += len(chunk)
        too_large = too_large or read > MAX_BODY_BYTES
        if too_large:
            body.clear()  # the rest is read and dropped
            if read > DRAIN_BYTES:
                break
        else:
            body += chunk
    if too_large:
        raise _too_large()
    return json_text.parse(bytes(body))


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")


async def api_error(request: HTTPRequest, exc: APIError) -> Response:
    request.app.state.server.metrics.error(exc.status)
    return exc.response()


async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
    return await api_error(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


async def internal_error(request: HTTPRequest, exc: Exception) -> Response:
    return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
