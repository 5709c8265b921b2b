"""Benchmark prompt sets come from installed packages' data files, in a fixed order."""

import pytest

from specbuild.errors import SpecbuildError
from specbuild.prompts import PROMPT_SETS, SUMMARIZE_INSTRUCTION, SUMMARIZE_MIN_CHARS, is_chat, load_prompt_set


def test_every_set_loads_and_is_stable():
    for name in PROMPT_SETS:
        first = load_prompt_set(name, 5)
        assert len(first) == 5 and all(isinstance(p, str) and p.strip() for p in first)
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
