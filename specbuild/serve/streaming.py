"""`stream: true`: the server-sent events of one request, as OpenAI clients expect them.

Chat: a role chunk first; then text deltas as the output decodes cleanly (text_deltas.py); a finish chunk with
finish_reason; a usage chunk when stream_options.include_usage; `data: [DONE]`. An error after the stream began is
sent as an error event, then `[DONE]`. A client that goes away cancels its request (its slot frees at the next step).
"""

from __future__ import annotations

from specbuild.serve.errors import APIError
from specbuild.serve.generation import Generation
from specbuild.serve.responses import DONE, Responses
from specbuild.serve.text_deltas import TextDeltas

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def events(generation: Generation, responses: Responses, include_usage: bool):
    """The request's SSE events (an async generator of str)."""
    handle = generation.handle
    deltas = TextDeltas(generation.engine.codec, handle.request.stop)
    try:
        if responses.chat:
            yield responses.chunk(role=True)
        async for _ in generation.steps():
            text = deltas.update(list(handle.output_ids))
            if text:
                yield responses.chunk(text)
        result = generation.result()
        text = deltas.finish(result.text or "")
        if text:
            yield responses.chunk(text)
        yield responses.chunk(finish_reason=generation.finish_reason)
        if include_usage:
            yield responses.usage_chunk(generation.usage(result))
    except APIError as exc:
        generation.metrics.error(exc.status)
        yield exc.sse()
    finally:
        generation.abandon()  # cancels it unless it finished (the client went away mid-stream)
    yield DONE
