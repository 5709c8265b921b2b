"""The OpenAI response bodies and stream chunks of chat and text completions (one choice, index 0)."""

from __future__ import annotations

import json
import time
import uuid

DONE = "data: [DONE]\n\n"


class Responses:
    """Bodies and chunks of one request: its id, creation time and model name are shared by all of them."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list, usage: dict | None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def complete(self, text: str, finish_reason: str, usage: dict) -> dict:
        """The non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            return self._envelope("chat.completion", [{**choice, "finish_reason": finish_reason}], usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], usage)

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> str:
        """One SSE event: a role chunk (chat), a text delta, or the finish chunk."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return event(self._envelope("chat.completion.chunk", [choice], None))
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return event(self._envelope("text_completion", [choice], None))

    def usage_chunk(self, usage: dict) -> str:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return event(self._envelope(kind, [], usage))


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, mean_accepted_tokens: float) -> dict:
    """OpenAI's usage, plus (an extension) the mean tokens each decode step accepted (drafts + the bonus token)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "mean_accepted_tokens_per_step": round(mean_accepted_tokens, 4),
    }
