"""OpenAI request bodies (/v1/completions, /v1/chat/completions) checked and turned into one scheduler request.

Every refusal is an APIError naming the parameter at fault; the sampling values are checked by the runtime's own
SamplingParams. Features the runtime lacks (several choices, logprobs, penalties, tools) are refused, not ignored.
"""

from __future__ import annotations

import dataclasses
import secrets

from specbuild.errors import SpecbuildError
from specbuild.runtime.sampling import SamplingError, SamplingParams, is_integer
from specbuild.runtime.scheduler import Request
from specbuild.serve.errors import APIError, bad_request

MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")
# parameter -> the value that means "off" (anything else is refused)
UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
}


@dataclasses.dataclass
class GenerationRequest:
    """What a valid body asks for: prompt ids, the length limit, sampling, stop strings and how to answer."""

    chat: bool
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    draft_options: dict | None = None  # extension: the request's own drafting settings (Drafter.narrowed)

    def request(self, tenant: str | None = None) -> Request:
        """The scheduler request it asks for, made for `tenant` (the API key's, access.py)."""
        return Request(
            self.ids, self.max_tokens, self.sampling, self.stop, draft_options=self.draft_options, tenant=tenant
        )


def parse_chat(body, engine, model_name: str) -> GenerationRequest:
    body = _common_checks(body, model_name)
    messages = _messages(body.get("messages"))
    try:
        text = engine.codec.render_chat(messages)
    except SpecbuildError as exc:
        raise bad_request(str(exc), "messages") from None
    except Exception as exc:  # noqa: BLE001 - a template may raise anything (jinja2 errors, raise_exception)
        raise bad_request(f"the engine's chat template refused these messages: {exc}", "messages") from None
    limit = body.get("max_completion_tokens")
    param = "max_completion_tokens" if limit is not None else "max_tokens"
    return _request(body, engine, engine.codec.encode(text), "messages", True, param)


def parse_completion(body, engine, model_name: str) -> GenerationRequest:
    body = _common_checks(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = engine.codec.prompt_ids(prompt) if prompt else []
    elif isinstance(prompt, list) and prompt and all(is_integer(i) for i in prompt):
        ids = [int(i) for i in prompt]
    else:
        raise bad_request("prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")
    return _request(body, engine, ids, "prompt", False, "max_tokens")


def _common_checks(body, model_name: str) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required: a string (see /v1/models)", "model")
    if model != model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{model_name}`", "model")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request(f"n must be 1 (one choice per request), got {n!r}", "n")
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise bad_request(f"{name} is not supported by this server", name)
    if not isinstance(body.get("stream", False), bool):
        raise bad_request("stream must be true or false", "stream")
    return body


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        out.append({"role": "system" if role == "developer" else role, "content": _content(message, where)})
    return out


def _content(message: dict, where: str) -> str:
    """A message's text: a string, or a list of text parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_request(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _request(body: dict, engine, ids: list[int], prompt_param: str, chat: bool, limit_param: str):
    try:
        ids = engine.check_prompt(ids)
    except SpecbuildError as exc:
        raise bad_request(str(exc), prompt_param) from None
    room = engine.max_seq_len - len(ids)
    max_tokens = body.get(limit_param)
    if max_tokens is None:
        max_tokens = room
    elif not is_integer(max_tokens) or max_tokens < 1:
        raise bad_request(f"{limit_param} must be an integer >= 1, got {max_tokens!r}", limit_param)
    elif max_tokens > room:
        raise bad_request(
            f"this engine's context is {engine.max_seq_len} tokens; the prompt has {len(ids)}, so {limit_param} "
            f"must be at most {room}, got {max_tokens}",
            limit_param,
        )
    stream = body.get("stream", False)
    return GenerationRequest(
        chat=chat,
        ids=ids,
        max_tokens=int(max_tokens),
        sampling=_sampling(body),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        draft_options=_draft_options(body.get("draft_options"), engine),
    )


def _draft_options(options, engine) -> dict | None:
    """The extension field draft_options: {name: value} the engine's drafter accepts (e.g. a smaller window)."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise bad_request('draft_options must be an object like {"window": 2}', "draft_options")
    try:
        engine.drafting_settings(options)
    except SpecbuildError as exc:
        raise bad_request(str(exc), "draft_options") from None
    return options


def _sampling(body: dict) -> SamplingParams:
    """OpenAI's defaults: temperature 1, top_p 1, a fresh seed per request; top_k is an extension (0 or -1: off)."""
    values = {
        "temperature": _or_default(body, "temperature", 1.0),
        "top_p": _or_default(body, "top_p", 1.0),
        "top_k": _or_default(body, "top_k", 0),
        "seed": _or_default(body, "seed", None),
    }
    if values["top_k"] == -1:
        values["top_k"] = 0
    if values["seed"] is None:
        values["seed"] = secrets.randbelow(2**31)
    try:
        return SamplingParams(**values)  # errors name the request's parameters: the fields' own names
    except SamplingError as exc:
        raise bad_request(str(exc), exc.field) from None


def _or_default(body: dict, name: str, default):
    value = body.get(name)
    return default if value is None else value


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def _include_usage(options, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad_request('stream_options must be an object like {"include_usage": true}', "stream_options")
    return options.get("include_usage", False)
