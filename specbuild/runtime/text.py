"""Tokenizer and chat template for the runtime (tokenizers + jinja2; no transformers)."""

from __future__ import annotations

from pathlib import Path

from specbuild.errors import SpecbuildError


class TextCodec:
    def __init__(self, tokenizer_file: Path, chat_template: str | None = None):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.chat_template = chat_template
        self._template = None  # compiled on first use, then shared (a server renders every chat request with it)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def prompt_ids(self, text: str, chat: bool = False) -> list[int]:
        """A prompt's ids as transformers makes them: the chat template's text (which holds any BOS it wants), or the
        raw text with the tokenizer's special tokens (the BOS of a model that has one, e.g. Gemma)."""
        if chat:
            return self.encode(self.apply_chat(text))
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat(self, user_message: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_message}
        ]
        return self.render_chat(messages)

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template over a conversation ({"role", "content"} dicts), ready for the assistant's reply."""
        if not self.chat_template:
            raise SpecbuildError("this engine's tokenizer has no chat template; run without --chat")
        if self._template is None:
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)  # rendering is thread-safe; compiling is costly
        return self._template.render(messages=messages, add_generation_prompt=True)

    def stream(self):
        """An incremental decoder: feed ids one at a time, get the new text (or '')."""
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(skip_special_tokens=True)

            def step(token_id: int) -> str:
                return stream.step(self.tokenizer, token_id) or ""

            return step
        except ImportError:  # older tokenizers: re-decode the tail
            seen: list[int] = []
            printed = [""]

            def step(token_id: int) -> str:
                seen.append(token_id)
                text = self.decode(seen)
                new = text[len(printed[0]) :]
                printed[0] = text
                return new

            return step
