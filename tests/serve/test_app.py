"""The routes against a real server: /v1/models, chat and text completions (their text is `specbuild run`'s at
temperature 0), usage, /health, /metrics, and every bad request answered with an OpenAI-style error while the
server keeps serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import yaml

from tests.serve.conftest import MAX_SEQ_LEN

pytestmark = pytest.mark.xdist_group("serve")

PROMPTS = ["Hello there", "def f(x): return x", "abcabcabc", "The quick brown fox"]


def test_models_lists_the_engine(none_server, serve_engines):
    models = none_server.client().models.list().data
    assert [m.id for m in models] == [serve_engines["none"].name]
    assert models[0].model_extra["max_model_len"] == MAX_SEQ_LEN


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_chat_and_completion_give_the_engines_text(none_server, reference_engine, prompt):
    client, model = none_server.client(), reference_engine.path.name
    want_chat = reference_engine.generate(prompt=prompt, chat=True, max_new_tokens=40)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=40
    )
    assert chat.choices[0].message.content == want_chat.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == ("length" if want_chat.stop_reason == "max_new_tokens" else "stop")
    assert chat.usage.prompt_tokens == want_chat.prompt_tokens
    assert chat.usage.completion_tokens == len(want_chat.output_ids)
    assert chat.usage.total_tokens == want_chat.prompt_tokens + len(want_chat.output_ids)
    assert chat.usage.model_extra["mean_accepted_tokens_per_step"] == pytest.approx(want_chat.mean_accepted_tokens)

    want_text = reference_engine.generate(prompt=prompt, max_new_tokens=30)
    completion = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=30)
    assert completion.choices[0].text == want_text.text
    assert completion.usage.completion_tokens == len(want_text.output_ids)


def test_a_speculative_engine_serves_the_none_engines_text(ngram_server, reference_engine):
    """Lossless: the ngram engine's greedy text over HTTP is the none engine's."""
    want = reference_engine.generate(prompt="abcabcabcabc", chat=True, max_new_tokens=60)
    got = ngram_server.client().chat.completions.create(
        model=ngram_server.model, messages=[{"role": "user", "content": "abcabcabcabc"}], max_tokens=60, temperature=0
    )
    assert got.choices[0].message.content == want.text


def test_stop_strings_end_the_text_before_them(none_server, reference_engine):
    full = reference_engine.generate(prompt=PROMPTS[0], max_new_tokens=40).text
    stop = full[10:12]
    want = reference_engine.generate(prompt=PROMPTS[0], max_new_tokens=40, stop=[stop])
    got = none_server.client().completions.create(
        model=reference_engine.path.name, prompt=PROMPTS[0], temperature=0, max_tokens=40, stop=[stop, "zzzz"]
    )
    assert got.choices[0].text == want.text == full[: full.find(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(none_server, reference_engine):
    client, model = none_server.client(), reference_engine.path.name
    sampling = dict(temperature=0.9, seed=7, extra_body={"top_k": 20})
    texts = [client.completions.create(model=model, prompt="abc", max_tokens=20, **sampling) for _ in range(2)]
    assert texts[0].choices[0].text == texts[1].choices[0].text


def _nested(levels: int):
    value = 0
    for _ in range(levels):
        value = [value]
    return value


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


BAD_REQUESTS = {
    "malformed json": ("/v1/chat/completions", b'{"model": "m", "messages": [', 400, None),
    "not an object": ("/v1/chat/completions", [1, 2], 400, None),
    "unknown model": ("/v1/chat/completions", _chat(model="gpt-nothing"), 404, "model"),
    "no model": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    "missing messages": ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    "empty messages": ("/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    "messages not a list": ("/v1/chat/completions", _chat(messages="hi"), 400, "messages"),
    "bad role": ("/v1/chat/completions", _chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    "content a number": ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), 400, None),
    "prompt too long": ("/v1/completions", {"prompt": "ab" * MAX_SEQ_LEN, "max_tokens": 4}, 400, "prompt"),
    "id outside the vocabulary": ("/v1/completions", {"prompt": [5, 100000]}, 400, "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "max_tokens beyond the context": ("/v1/completions", {"prompt": "a", "max_tokens": MAX_SEQ_LEN}, 400, "max_tokens"),
    "max_tokens zero": ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens a string": ("/v1/chat/completions", _chat(max_tokens="10"), 400, "max_tokens"),
    "negative temperature": ("/v1/chat/completions", _chat(temperature=-1), 400, "temperature"),
    "temperature a string": ("/v1/chat/completions", _chat(temperature="hot"), 400, "temperature"),
    "top_p zero": ("/v1/chat/completions", _chat(top_p=0), 400, "top_p"),
    "fractional top_k": ("/v1/chat/completions", _chat(top_k=1.5), 400, "top_k"),
    "negative seed": ("/v1/chat/completions", _chat(seed=-3), 400, "seed"),
    "n of 2": ("/v1/chat/completions", _chat(n=2), 400, "n"),
    "stop a number": ("/v1/chat/completions", _chat(stop=5), 400, "stop"),
    "logprobs": ("/v1/chat/completions", _chat(logprobs=True), 400, "logprobs"),
    "stream not a bool": ("/v1/chat/completions", _chat(stream="yes"), 400, "stream"),
    "stream_options without stream": ("/v1/chat/completions", _chat(stream_options={}), 400, "stream_options"),
    "draft_options of a mode without them": (
        "/v1/completions",
        {"prompt": "a", "draft_options": {"window": 2}},
        400,
        "draft_options",
    ),
    "draft_options not an object": ("/v1/completions", {"prompt": "a", "draft_options": [2]}, 400, "draft_options"),
    "body of two megabytes": ("/v1/completions", {"prompt": "a" * (2 << 20)}, 413, None),
    "nested 100,000 levels deep": ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    "nested 70 levels deep": ("/v1/chat/completions", _chat(metadata=_nested(70)), 400, None),
    "lone surrogate in a message": (
        "/v1/chat/completions",
        _chat(messages=[_user("a\ud800b")]),
        400,
        "messages[0].content",
    ),
    "lone surrogate in a prompt": ("/v1/completions", {"prompt": "\udfff", "max_tokens": 2}, 400, "prompt"),
    "lone surrogate in a stop string": ("/v1/chat/completions", _chat(stop=["ok", "\ud800"]), 400, "stop[1]"),
    "lone surrogate in a key": ("/v1/chat/completions", _chat(**{"\ud800": 1}), 400, None),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_request_gets_its_error_and_the_server_keeps_serving(none_server, serve_engines, case):
    path, body, status, param = BAD_REQUESTS[case]
    if isinstance(body, dict) and "model" not in body and case != "no model":
        body = {"model": serve_engines["none"].name, **body}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(none_server.url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param
    assert none_server.health().status_code == 200


def test_control_characters_are_text(none_server, reference_engine):
    """NUL and other control characters are valid text: the tokenizer takes them (only lone surrogates are not)."""
    want = reference_engine.generate(prompt="a\x00b\x01c", max_new_tokens=5)
    got = none_server.client().completions.create(
        model=none_server.model, prompt="a\x00b\x01c", max_tokens=5, temperature=0
    )
    assert got.choices[0].text == want.text


@pytest.mark.parametrize("chunked", [True, False])
def test_a_client_still_sending_an_oversized_body_reads_its_413(none_server, chunked):
    """The body is sent slowly in pieces (chunked, or with its Content-Length) and the client reads the 413 after it
    has sent it all, not a reset connection (the server reads an oversized body to its end, up to 16 MiB, before it
    answers and closes)."""
    import http.client
    import time

    piece = b"x" * (64 << 10)

    def body():
        yield b'{"model": "m", "prompt": "'
        for _ in range(32):  # 2 MiB
            time.sleep(0.005)
            yield piece
        yield b'"}'

    headers = {"Content-Type": "application/json"}
    if not chunked:
        headers["Content-Length"] = str(sum(len(p) for p in body()))
    connection = http.client.HTTPConnection("127.0.0.1", none_server.port, timeout=30)
    connection.request("POST", "/v1/completions", body=body(), headers=headers, encode_chunked=chunked)
    response = connection.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"]["code"] == 413
    connection.close()
    assert none_server.health().status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(none_server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
        response = httpx.request(method, none_server.url + path)
        assert response.status_code == status
        assert response.json()["error"]["code"] == status


def test_the_openai_client_raises_the_servers_errors(none_server, serve_engines):
    client = none_server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model=serve_engines["none"].name, prompt="x", n=3, max_tokens=2)


def test_a_full_queue_answers_429_and_the_rest_complete(ngram_server, serve_engines):
    """One slot and one waiting place: of five long requests sent at once, those beyond the two places get 429 (how
    many depends on when each arrives) and the others complete."""

    async def send_all():
        client = ngram_server.async_client()
        model = serve_engines["ngram"].name
        await client.models.list()  # the client's first request sets it up (slowly): not in the burst

        async def one(i):
            try:
                reply = await client.completions.create(model=model, prompt=f"q{i}", max_tokens=2000, temperature=0)
                return reply.usage.completion_tokens
            except openai.RateLimitError as exc:
                return exc

        return await asyncio.gather(*(one(i) for i in range(5)))

    outcomes = asyncio.run(send_all())
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    served = [o for o in outcomes if not isinstance(o, openai.RateLimitError)]
    assert refused and len(served) >= 2 and set(served) == {2000}
    assert refused[0].status_code == 429 and "--max-queue 1" in refused[0].body["message"]
    assert ngram_server.health().status_code == 200


def test_metrics_count_requests_tokens_latency_and_drafts(ngram_server, serve_engines):
    client, model = ngram_server.client(), serve_engines["ngram"].name
    before = ngram_server.metric("specbuild:generation_tokens_total")
    reply = client.completions.create(model=model, prompt="abcabcabcabc", max_tokens=50, temperature=0)
    assert reply.usage.model_extra["mean_accepted_tokens_per_step"] >= 1.0
    assert ngram_server.metric("specbuild:generation_tokens_total") == before + 50
    assert ngram_server.metric("specbuild:request_success_total") >= 1
    assert ngram_server.metric("specbuild:time_to_first_token_seconds_count") >= 1
    assert ngram_server.metric("specbuild:inter_token_latency_seconds_count") >= 1
    assert ngram_server.metric("specbuild:e2e_request_latency_seconds_count") >= 1
    drafts = ngram_server.metric("specbuild:spec_decode_num_drafts_total")
    draft_tokens = ngram_server.metric("specbuild:spec_decode_num_draft_tokens_total")
    accepted = ngram_server.metric("specbuild:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
    assert ngram_server.metric("specbuild:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert ngram_server.metric("specbuild:request_errors_total") >= 0
    # the KV cache: at least the 50 tokens' positions written (its one slot), at most every position of that slot
    model_fields = yaml.safe_load((serve_engines["ngram"] / "engine.yaml").read_text())["model"]
    position = model_fields["num_layers"] * 2 * model_fields["num_kv_heads"] * model_fields["head_dim"] * 4
    held, bound = ngram_server.metric("specbuild:kv_cache_bytes"), ngram_server.metric("specbuild:kv_cache_bound_bytes")
    assert 50 * position <= held < bound and bound >= MAX_SEQ_LEN * position


def test_a_burst_of_connections_is_served_or_refused_and_the_server_keeps_serving(none_server):
    """300 requests at once on 16 slots and 64 waiting places: each is answered, 200 or 429."""

    async def burst():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            body = {"model": none_server.model, "prompt": "burst", "max_tokens": 20, "temperature": 0}
            replies = await asyncio.gather(
                *(client.post(none_server.url + "/v1/completions", json=body) for _ in range(300))
            )
        return [r.status_code for r in replies]

    statuses = asyncio.run(burst())
    assert set(statuses) <= {200, 429} and 200 in statuses
    assert none_server.health().status_code == 200
