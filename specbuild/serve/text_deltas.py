"""A streamed request's text, released as it decodes cleanly: never half of a multi-byte character, never the start
of a stop string; the deltas add up to exactly the text of the finished request (`Engine.result`)."""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of a character not complete yet


class TextDeltas:
    """Feed a request's output ids after each step; get the text not sent before (possibly '')."""

    def __init__(self, codec, stops: tuple[str, ...] = ()):
        self.codec = codec
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that may begin a stop string
        self.sent = ""

    def update(self, output_ids: list[int]) -> str:
        """The new text that is safe to send while the request runs (the output may already hold a stop string:
        the request ends with the step that completed it)."""
        text = self.codec.decode(output_ids).rstrip(REPLACEMENT)
        found = [text.find(s) for s in self.stops if s in text]
        if found:
            return self._advance(text[: min(found)])
        return self._advance(text[: len(text) - self.hold] if self.hold else text)

    def finish(self, final_text: str) -> str:
        """The rest of the finished request's text (its stop string cut off)."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
