"""Streamed text deltas: never half a character, never the start of a stop string, and they add up to the text."""

from specbuild.serve.text_deltas import TextDeltas


class BytesCodec:
    """Token ids are bytes of UTF-8 text; an incomplete character decodes to U+FFFD (as byte-level tokenizers do)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str, stops=(), final: str | None = None) -> list[str]:
    ids = list(text.encode())
    deltas = TextDeltas(BytesCodec(), stops)
    out = [deltas.update(ids[: i + 1]) for i in range(len(ids))]
    return [*out, deltas.finish(text if final is None else final)]


def test_multi_byte_characters_are_never_split():
    text = "naïve 日本 🙂!"
    out = _stream(text)
    assert "".join(out) == text
    assert all("\ufffd" not in d for d in out)
    assert "日" in out  # released whole, as soon as its last byte arrived


def test_text_that_may_begin_a_stop_string_is_held_back():
    out = _stream("hello STOP", stops=("STOP",), final="hello ")
    assert "".join(out) == "hello "
    assert all("S" not in d for d in out)


def test_a_completed_stop_string_is_cut_before_the_request_says_it_stopped():
    deltas = TextDeltas(BytesCodec(), ("ST",))
    assert deltas.update(list(b"ab ST")) == "ab "
    assert deltas.finish("ab ") == ""
