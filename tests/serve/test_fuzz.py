"""Fuzzing every route of a real server with hypothesis: valid requests with fields replaced by arbitrary JSON (NaN,
huge numbers, lone surrogates, deep nesting, wrong types), raw bytes, every method on every path. Nothing answers
5xx (in the status or in a stream's error events), every refusal is an OpenAI-style JSON error, and the server
answers a valid request correctly afterwards.

Examples are drawn from a fixed seed (derandomize) so that CI is repeatable; SPECBUILD_FUZZ_EXAMPLES=N draws more."""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.xdist_group("serve")

EXAMPLES = int(os.environ.get("SPECBUILD_FUZZ_EXAMPLES", "300"))
PATHS = ["/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/nothing", "/"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]

HARD_CHARACTERS = st.sampled_from(["\ud800", "\udfff", "\x00", "\ufffe", "\u2028", "\U0010ffff"])
# joined lists of characters: st.text leaves lone surrogates out
ANY_TEXT = st.lists(st.characters(codec=None, exclude_categories=()) | HARD_CHARACTERS, max_size=12).map("".join)
SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) | ANY_TEXT
)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3), max_leaves=6
)
DEEP = st.integers(40, 400).map(lambda n: json.loads("[" * n + "]" * n))  # deeper: in raw bytes below
DEEP_BYTES = st.integers(40, 200_000).map(lambda n: b'{"a": ' + b"[" * n + b"]" * n + b"}")
SMALL_LIMITS = st.integers(-2, 6) | st.sampled_from([0.5, 2.0, 1e30, math.inf, "3", True])
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]) | JSON_VALUES,
     "content": ANY_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": ANY_TEXT}), max_size=2)
     | JSON_VALUES}
)  # fmt: skip
CHAT_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": ANY_TEXT})
# per field: values of the right shape (that reach the tokenizer, the sampler, the stop strings) or anything
FIELDS = {
    "messages": st.lists(CHAT_MESSAGE, min_size=1, max_size=3) | st.lists(MESSAGE, max_size=3) | JSON_VALUES,
    "prompt": ANY_TEXT | st.lists(st.integers(-5, 400), max_size=6) | JSON_VALUES,
    "max_tokens": SMALL_LIMITS,
    "max_completion_tokens": SMALL_LIMITS,
    "temperature": st.floats(0, 2) | st.floats(allow_nan=True) | JSON_VALUES,
    "top_p": st.floats(0, 1) | st.floats(allow_nan=True) | JSON_VALUES,
    "top_k": st.integers(-3, 10**12) | JSON_VALUES,
    "min_p": st.floats(0, 1) | st.floats(allow_nan=True) | JSON_VALUES,
    "seed": st.integers(-(2**70), 2**70) | JSON_VALUES,
    "stop": ANY_TEXT | st.lists(ANY_TEXT, max_size=4) | st.lists(ANY_TEXT, max_size=20) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON_VALUES}) | JSON_VALUES,
    "n": st.integers(-1, 3) | JSON_VALUES,
    "logprobs": JSON_VALUES,
    "draft_options": st.dictionaries(ANY_TEXT, JSON_VALUES, max_size=2) | JSON_VALUES,
    "metadata": DEEP | JSON_VALUES,
    "model": ANY_TEXT | JSON_VALUES,
}


@st.composite
def bodies(draw, model: str):
    """A valid chat or text completion request with some of its fields replaced, added or removed."""
    chat = draw(st.booleans())
    body = {"model": model, "max_tokens": 3, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "abc"})
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(FIELDS[name])
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 3  # a request without a limit runs to the context's end: seconds each
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@st.composite
def text_bodies(draw, model: str):
    """A valid request but for its text: the prompt or the messages' contents, and the stop strings, any text."""
    body = {"model": model, "max_tokens": 3, "temperature": 0, "stream": draw(st.booleans())}
    if draw(st.booleans()):
        body["messages"] = draw(st.lists(CHAT_MESSAGE, min_size=1, max_size=3))
        path = "/v1/chat/completions"
    else:
        body["prompt"], path = draw(ANY_TEXT), "/v1/completions"
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(ANY_TEXT, max_size=4))
    return path, body


def _encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")  # keeps \ud800 as JSON escapes


def _check(response: httpx.Response, what) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"], (what, response.text[:500])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                assert json.loads(line[len("data: ") :])["error"]["code"] < 500, (what, line)


@pytest.fixture(scope="module")
def http(none_server):
    with httpx.Client(base_url=none_server.url, timeout=60) as client:
        yield client


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(data=st.data())
def test_mutated_requests_never_get_a_5xx(http, none_server, data):
    path, body = data.draw(bodies(none_server.model))
    _check(http.post(path, content=_encode(body), headers={"content-type": "application/json"}), body)


@FUZZ
@given(data=st.data())
def test_any_text_never_gets_a_5xx(http, none_server, data):
    path, body = data.draw(text_bodies(none_server.model))
    _check(http.post(path, content=_encode(body), headers={"content-type": "application/json"}), body)


@FUZZ
@given(
    method=st.sampled_from(METHODS),
    path=st.sampled_from(PATHS),
    content=st.binary(max_size=64) | JSON_VALUES.map(_encode) | DEEP_BYTES,
    content_type=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]),
)
def test_any_bytes_on_any_route_never_get_a_5xx(http, method, path, content, content_type):
    response = http.request(method, path, content=content, headers={"content-type": content_type})
    _check(response, (method, path, content))


def test_the_server_serves_correctly_after_the_fuzz(http, none_server, reference_engine):
    """Runs after the fuzz tests above (file order): still healthy, still exact."""
    assert none_server.health().status_code == 200
    want = reference_engine.generate(prompt="abcabc", max_new_tokens=8)
    body = {"model": none_server.model, "prompt": "abcabc", "max_tokens": 8, "temperature": 0}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == want.text
    assert none_server.metric("specbuild:num_requests_running") == 0
