"""What the requests ask: real prompts (specbuild.prompts sets, interleaved) written as an AIPerf `single_turn`
JSONL file, or AIPerf's synthetic prompts of a fixed length. Every request asks for the same number of tokens."""

from __future__ import annotations

import json
from pathlib import Path

from specbuild.errors import SpecbuildError

SYNTHETIC = "synthetic:"


def dataset_args(spec: str, requests: int, output_tokens: int, out_dir: Path) -> list[str]:
    """AIPerf's input arguments for `--prompts SPEC`: prompt set names ('mtbench', 'humaneval,mtbench') or
    'synthetic:ISL' (random text of ISL tokens)."""
    if spec.startswith(SYNTHETIC):
        length = spec.removeprefix(SYNTHETIC)
        if not length.isdigit() or int(length) < 1:
            raise SpecbuildError(f"--prompts {spec}: expected synthetic:N with N >= 1 input tokens")
        return ["--synthetic-input-tokens-mean", length, "--synthetic-input-tokens-stddev", "0"]
    path = write_prompts_file(spec.split(","), requests, output_tokens, out_dir / "prompts.jsonl")
    return [
        "--input-file", str(path),
        "--custom-dataset-type", "single_turn",
        "--dataset-sampling-strategy", "sequential",  # every engine gets the same prompts in the same order
    ]  # fmt: skip


def interleaved_texts(prompt_sets: list[str], count: int) -> list[str]:
    """`count` prompts taking the sets in turn (mixed lengths in flight together), first prompts first."""
    from specbuild.prompts import load_prompt_set

    per_set = [load_prompt_set(name.strip()) for name in prompt_sets]
    for name, group in zip(prompt_sets, per_set):
        if group and not isinstance(group[0], str):
            raise SpecbuildError(f"--prompts {name.strip()}: its prompts are whole conversations, which AIPerf's "
                                 "single_turn file cannot hold; run it with `specbuild bench`")  # fmt: skip
    mixed = [group[i] for i in range(max(map(len, per_set))) for group in per_set if i < len(group)]
    return mixed[:count]


def write_prompts_file(prompt_sets: list[str], requests: int, output_tokens: int, path: Path) -> Path:
    """One chat turn per line; AIPerf sends each as the user message, with max tokens = output_tokens."""
    texts = interleaved_texts(prompt_sets, requests)
    with open(path, "w", encoding="utf-8") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text, "output_length": output_tokens}) + "\n")
    return path
