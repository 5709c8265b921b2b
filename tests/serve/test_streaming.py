"""`stream: true` against a real server: the chunks OpenAI clients expect, text identical to the non-streamed one,
16 concurrent streams identical to one-at-a-time runs, and a client that goes away mid-stream frees its slot."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.xdist_group("serve")


def _events(server, path: str, body: dict) -> list:
    """The decoded `data:` payloads of one streamed request ('[DONE]' kept as a string)."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_chat_stream_has_role_deltas_finish_usage_and_done(none_server, reference_engine):
    model = reference_engine.path.name
    want = reference_engine.generate(prompt="Hello", chat=True, max_new_tokens=25)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 25,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _events(none_server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = chunks[1:-2]
    assert deltas and all(c["choices"][0]["finish_reason"] is None for c in deltas)
    assert "".join(c["choices"][0]["delta"]["content"] for c in deltas) == want.text
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 25


def test_openai_client_streams_text_completions(none_server, reference_engine):
    model = reference_engine.path.name
    want = reference_engine.generate(prompt="abc", max_new_tokens=30, stop=["zz"])
    stream = none_server.client().completions.create(
        model=model, prompt="abc", max_tokens=30, temperature=0, stream=True, stop="zz"
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def _sampling(i: int) -> dict:
    return {"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i, "extra_body": {"top_k": 10}}


def test_sixteen_concurrent_streams_equal_their_runs_one_at_a_time(none_server, reference_engine):
    model = reference_engine.path.name
    prompts = [f"prompt number {i}: " + "xy" * i for i in range(16)]

    async def stream_one(client, i):
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=10 + 3 * i,
            stream=True,
            **_sampling(i),
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run(concurrent: bool):
        client = none_server.async_client()
        await client.models.list()  # the client's first request sets it up (slowly): not in the burst
        if concurrent:
            return await asyncio.gather(*(stream_one(client, i) for i in range(16)))
        return [await stream_one(client, i) for i in range(16)]

    alone = asyncio.run(run(False))
    together = asyncio.run(run(True))
    assert together == alone
    assert all(alone)


def test_a_client_gone_mid_stream_frees_its_slot(ngram_server, serve_engines):
    """The one slot is taken by a long stream whose client leaves after its first tokens: the request is cancelled
    at once (not run to its 4000 tokens) and the next requests complete."""
    model = serve_engines["ngram"].name
    cancelled = ngram_server.metric("specbuild:request_cancelled_total")
    body = {"model": model, "prompt": "long", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.stream("POST", ngram_server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    deadline = time.monotonic() + 5
    while ngram_server.metric("specbuild:request_cancelled_total") == cancelled:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.02)
    assert ngram_server.metric("specbuild:num_requests_running") == 0
    client = ngram_server.client(timeout=10)
    for i in range(3):
        reply = client.completions.create(model=model, prompt=f"next {i}", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8


def test_a_client_gone_before_its_reply_frees_its_slot(ngram_server, serve_engines):
    """Non-streamed: the client times out and disconnects; the request is cancelled and the slot frees."""
    model = serve_engines["ngram"].name
    cancelled = ngram_server.metric("specbuild:request_cancelled_total")
    body = {"model": model, "prompt": "long", "max_tokens": 4000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(ngram_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.2))
    deadline = time.monotonic() + 5
    while ngram_server.metric("specbuild:request_cancelled_total") == cancelled:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.02)
    reply = ngram_server.client(timeout=10).completions.create(model=model, prompt="after", max_tokens=8)
    assert reply.usage.completion_tokens == 8
