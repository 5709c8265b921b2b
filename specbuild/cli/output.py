"""What the `specbuild` commands print: progress on a stderr console, and a generation (`run`, `demo`) streamed to
stdout with its statistics on stderr, or as one JSON object.
"""

from __future__ import annotations

import json
import sys

import click


def stderr_console():
    """A rich console on stderr (progress and logs; stdout stays for results)."""
    from rich.console import Console

    return Console(stderr=True)


def _stats_line(result) -> str:
    return (
        f"{len(result.output_ids)} tokens, {result.steps} steps, τ {result.mean_accepted_tokens:.2f}, "
        f"{result.tokens_per_s:.1f} tok/s (decode {result.decode_tokens_per_s:.1f}), "
        f"TTFT {1000 * result.ttft_s:.0f} ms, stop: {result.stop_reason}"
    )


def generate_and_print(engine, prompt, input_ids, max_new_tokens, sampling, chat, as_json, draft_options=None):
    """Generate; stream text to stdout (or print one JSON object), stats on stderr. Returns the result."""
    has_tokenizer = bool(engine.manifest["files"].get("tokenizer"))
    stream = None
    if not as_json and has_tokenizer:
        step = engine.codec.stream()

        def stream(new_ids):
            for tok in new_ids:
                piece = step(tok)
                if piece:
                    sys.stdout.write(piece)
            sys.stdout.flush()

    result = engine.generate(
        prompt=prompt,
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stream=stream,
        chat=chat,
        draft_options=draft_options,
    )
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "exactness": engine.exactness.to_dict()}))
    else:
        if has_tokenizer:
            sys.stdout.write("\n")
        else:
            click.echo(" ".join(str(i) for i in result.output_ids))
        sys.stdout.flush()
        click.echo(_stats_line(result), err=True)
    return result
