"""runtime/text.py: a prompt's ids as transformers makes them (raw text with the tokenizer's special tokens, or the
chat template's text), decoding, a streaming decoder whose pieces add up to the decoded text, and a chat request to
an engine without a template refused in one line."""

import pytest

from specbuild.errors import SpecbuildError
from specbuild.runtime.text import TextCodec
from tests.helpers import write_char_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    write_char_tokenizer(folder)
    return folder / "tokenizer.json"


def test_prompt_ids_are_the_raw_text_or_the_chat_templates(tokenizer):
    codec = TextCodec(tokenizer, TEMPLATE)
    assert codec.decode(codec.encode("def f(x):")) == "def f(x):"
    assert codec.prompt_ids("hi there") == codec.encode("hi there", add_special_tokens=True)
    assert codec.apply_chat("hi", system="be brief") == "<system>be brief<user>hi<assistant>"
    assert codec.prompt_ids("hi", chat=True) == codec.encode("<user>hi<assistant>")
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert codec.render_chat(messages) == "<user>a<assistant>b<user>c<assistant>"
    assert codec._template is not None  # compiled once, then shared


def test_the_stream_decodes_piece_by_piece_what_decode_gives_whole(tokenizer):
    codec = TextCodec(tokenizer)
    ids = codec.encode("the quick brown fox, twice: the quick brown fox")
    step = codec.stream()
    assert "".join(step(i) for i in ids) == codec.decode(ids)


def test_a_chat_without_a_template_is_one_line(tokenizer):
    with pytest.raises(SpecbuildError, match="has no chat template; run without --chat"):
        TextCodec(tokenizer).prompt_ids("hi", chat=True)
