"""What a Triton request carries and what each of its streamed responses holds, shared by `specbuild serve --triton`
(PyTriton, triton_pytriton.py) and the Python-backend model of `specbuild triton-repo` (triton_backend.py).

Inputs are named like TensorRT-LLM's Triton ensemble, so that its clients and Triton's generate extension
(`POST /v2/models/<name>/generate_stream` with `{"text_input": ..., "max_tokens": ...}`) work unchanged:
text_input (the raw prompt, no chat template), and optional max_tokens, temperature, top_p, top_k, seed and stop
(strings). Unlike the OpenAI endpoint, a request that gives no temperature decodes greedily (Triton's LLM clients
expect that). Every value is checked exactly as the OpenAI endpoint checks it (openai_schema.py); a refusal is one
line naming the input. Each engine step that gives the request tokens is one response: text_output (the text that
decodes cleanly so far, never the start of a stop string: text_deltas.py), output_ids (the step's new token ids) and
finish_reason ("" until the last response: "stop" or "length"); the text_output pieces add up to the OpenAI
endpoint's text and the output_ids to its tokens.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from specbuild.errors import SpecbuildError
from specbuild.serve.errors import APIError
from specbuild.serve.generation import FINISH_REASONS
from specbuild.serve.openai_schema import GenerationRequest, parse_completion
from specbuild.serve.text_deltas import TextDeltas


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name, numpy dtype (np.object_ holds bytes), shape (-1: any length), optional."""

    name: str
    dtype: type
    shape: tuple[int, ...]
    optional: bool = False

    @property
    def triton_type(self) -> str:
        return {np.object_: "TYPE_STRING", np.int32: "TYPE_INT32", np.int64: "TYPE_INT64"}.get(self.dtype, "TYPE_FP32")


INPUTS = (
    TensorSpec("text_input", np.object_, (1,)),
    TensorSpec("max_tokens", np.int32, (1,), optional=True),
    TensorSpec("temperature", np.float32, (1,), optional=True),
    TensorSpec("top_p", np.float32, (1,), optional=True),
    TensorSpec("top_k", np.int32, (1,), optional=True),
    TensorSpec("seed", np.int64, (1,), optional=True),
    TensorSpec("stop", np.object_, (-1,), optional=True),
)
OUTPUTS = (
    TensorSpec("text_output", np.object_, (1,)),
    TensorSpec("output_ids", np.int64, (-1,)),
    TensorSpec("finish_reason", np.object_, (1,)),
)
SCALARS = ("max_tokens", "temperature", "top_p", "top_k", "seed")
MODEL_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what Triton accepts as a model name


def check_model_name(name: str) -> str:
    if not MODEL_NAME.match(name):
        raise SpecbuildError(f"--model-name {name!r}: Triton model names hold only letters, digits, '.', '_' and '-'")
    return name


def parse_inputs(arrays: dict, engine, model_name: str) -> GenerationRequest:
    """A Triton request's input arrays (name -> numpy array, optional ones may be missing) as one scheduler
    request; an APIError (400) names the input at fault."""
    body: dict = {"model": model_name, "temperature": 0.0}
    text = arrays.get("text_input")
    if text is None or np.size(text) != 1:
        raise _bad("text_input must hold one string (the prompt)", "text_input")
    body["prompt"] = _string(np.ravel(text)[0], "text_input")
    for name in SCALARS:
        value = arrays.get(name)
        if value is None:
            continue
        if np.size(value) != 1:
            raise _bad(f"{name} must hold one value, got {np.size(value)}", name)
        body[name] = np.ravel(value)[0].item()
    stop = arrays.get("stop")
    if stop is not None:
        body["stop"] = [_string(s, "stop") for s in np.ravel(stop)]
    try:
        return parse_completion(body, engine, model_name)
    except APIError as exc:  # openai_schema names the OpenAI parameter; "prompt" is text_input here
        param = "text_input" if exc.param == "prompt" else exc.param
        raise APIError(exc.status, exc.message.replace("prompt", "text_input"), param) from None


class Responses:
    """The streamed responses of one request: `step()` after each engine step, `last()` once it finished."""

    def __init__(self, engine, handle):
        self.engine, self.handle = engine, handle
        self.deltas = TextDeltas(engine.codec, handle.request.stop)
        self.sent_ids = 0

    def step(self) -> dict:
        ids = list(self.handle.output_ids)
        new, self.sent_ids = ids[self.sent_ids :], len(ids)
        return response(self.deltas.update(ids), new, "")

    def last(self) -> dict:
        """The rest of the text (the stop string cut off) and the finish reason."""
        handle = self.handle
        if handle.error is not None:
            raise handle.error
        if handle.stop_reason == "cancelled":
            raise APIError(503, "the request was cancelled: the server is shutting down")
        text = self.deltas.finish(self.engine.result(handle).text or "")
        ids = list(handle.output_ids)
        new, self.sent_ids = ids[self.sent_ids :], len(ids)
        return response(text, new, FINISH_REASONS.get(handle.stop_reason, handle.stop_reason or ""))


def response(text: str, ids: list[int], finish_reason: str) -> dict:
    """One response's output arrays."""
    return {
        "text_output": np.array([text.encode()], dtype=np.object_),
        "output_ids": np.asarray(ids, dtype=np.int64),
        "finish_reason": np.array([finish_reason.encode()], dtype=np.object_),
    }


def _string(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise _bad(f"{name} is not valid UTF-8", name) from None
    if isinstance(value, str):
        return value
    raise _bad(f"{name} must be a string (BYTES), got {type(value).__name__}", name)


def _bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)
