"""Benchmark prompt sets come from installed packages' data files, in a fixed order."""

import pytest

from specbuild import task_prompts
from specbuild.errors import SpecbuildError
from specbuild.prompts import (
    PROMPT_SETS,
    SUMMARIZE_INSTRUCTION,
    SUMMARIZE_MIN_CHARS,
    is_chat,
    load_prompt_set,
    prompt_ids,
)


def test_every_set_loads_and_is_stable():
    for name in PROMPT_SETS:
        first = load_prompt_set(name, 5)
        texts = [p if isinstance(p, str) else p[-1]["content"] for p in first]
        assert len(first) == 5 and all(t.strip() for t in texts)
        assert load_prompt_set(name, 5) == first
    assert load_prompt_set("humaneval", 1)[0].startswith("from typing import List")
    assert not is_chat("humaneval") and is_chat("mtbench") and is_chat("summarize")


def test_summarize_prompts_hold_the_text_to_summarize():
    prompts = load_prompt_set("summarize")
    assert len(prompts) >= 20  # enough for a 20-prompt benchmark
    for p in prompts:
        assert p.startswith(SUMMARIZE_INSTRUCTION) and len(p) - len(SUMMARIZE_INSTRUCTION) >= SUMMARIZE_MIN_CHARS
    assert len(set(prompts)) == len(prompts)


def test_bad_sets_and_counts_are_one_line_errors():
    with pytest.raises(SpecbuildError, match="unknown prompt set 'xsum'"):
        load_prompt_set("xsum")
    with pytest.raises(SpecbuildError, match="must be >= 1"):
        load_prompt_set("summarize", 0)


def test_tasks_take_turns_under_one_system_prompt_per_kind():
    prompts = load_prompt_set("tasks", 30)
    systems = [task_prompts.EDIT_SYSTEM, task_prompts.EXTRACT_SYSTEM, task_prompts.CHAT_SYSTEM]
    for i, conversation in enumerate(prompts):
        assert conversation[0] == {"role": "system", "content": systems[i % 3]}
        assert [m["role"] for m in conversation[1:]] in (["user"], ["user", "assistant", "user"])
        assert all(m["content"].strip() for m in conversation)
    edits = [c[1]["content"] for c in prompts[0::3]]
    assert all("```python\ndef " in e or "```python\nfrom " in e or "```python\nimport " in e for e in edits)
    assert {e.split("\n")[0] for e in edits} == set(task_prompts.EDITS)  # every edit comes round
    assert all(len(c[-1]["content"]) <= len("Text:\n\n") + task_prompts.MAX_TEXT_CHARS for c in prompts[1::3])
    assert all(len(c) == 4 for c in prompts[2::3])  # a recorded exchange, then the user's next message
    assert len({str(c) for c in prompts}) == len(prompts)
    assert (
        load_prompt_set("tasks")[:30] == prompts and len(load_prompt_set("tasks")) == 3 * task_prompts.DEFAULT_PER_KIND
    )


class _Codec:
    """A codec that shows what it was given: ids are the characters' code points."""

    def __init__(self, template):
        self.chat_template = template

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in ("^" if add_special_tokens else "") + text]

    def render_chat(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def prompt_ids(self, text, chat=False):
        return self.encode(self.render_chat([{"role": "user", "content": text}])) if chat else self.encode(text, True)


def test_prompt_ids_render_conversations_with_the_chat_template_or_as_text_without_one():
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    as_text = "".join(map(chr, prompt_ids(_Codec("t"), "tasks", conversation)))
    assert as_text == "<system>S<user>U<assistant>"
    assert "".join(map(chr, prompt_ids(_Codec(None), "tasks", conversation))) == "^S\n\nU"
    assert "".join(map(chr, prompt_ids(_Codec("t"), "mtbench", "Q"))) == "<user>Q<assistant>"
    assert "".join(map(chr, prompt_ids(_Codec("t"), "humaneval", "def f"))) == "^def f"
