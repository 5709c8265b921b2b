"""A request body parsed as JSON the rest of the server can take, or one 400 error saying why not.

Refused, not repaired: bytes that are not UTF-8 JSON, nesting deeper than MAX_DEPTH (a body nested 100,000 levels
deep would otherwise exhaust Python's recursion in the parser), and strings holding a lone UTF-16 surrogate
(`"\\ud800"` is valid JSON but no UTF-8 text, so no tokenizer can take it). The error names where in the body the
string is. NUL and other control characters are valid text and pass to the tokenizer like any other character.
"""

from __future__ import annotations

import json

from specbuild.serve.errors import bad_request

MAX_DEPTH = 64  # levels of arrays/objects; an OpenAI request needs 4 (messages[i].content[j].text)


def parse(body: bytes):
    """The body's JSON value (400 for anything the server cannot take, see above)."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    check(value)
    return value


def check(value) -> None:
    """Walk the value (without recursion): depth at most MAX_DEPTH, every string and key UTF-8 text."""
    pending = [(value, "body", 0)]
    while pending:
        item, where, depth = pending.pop()
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, (dict, list)):
            if depth >= MAX_DEPTH:
                raise bad_request(f"the request body is nested deeper than {MAX_DEPTH} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, f"{where} key")
                    pending.append((child, key if where == "body" else f"{where}.{key}", depth + 1))
            else:
                pending.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise bad_request(
            f"{where} holds a lone UTF-16 surrogate (\\u{ord(bad):04x} at character {exc.start}), which is not text",
            where,
        ) from None
