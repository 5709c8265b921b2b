"""`specbuild run`: generate from an engine directory (base install: numpy and ONNX Runtime, no torch), from a prompt
or token ids, streamed or as JSON."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild.cli.handling import handle_errors
from specbuild.cli.options import ALLOW_LOSSY_HELP, check_choice, sampling_options, sampling_params
from specbuild.cli.output import generate_and_print
from specbuild.errors import SpecbuildError

BACKEND_CHOICES = ("onnxruntime", "tensorrt")


def parse_input_ids(text: str) -> list[int]:
    """'1,2,3' (spaces allowed) -> [1, 2, 3]; anything else is a SpecbuildError."""
    parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
    if not parts:
        raise SpecbuildError(f"--input-ids {text!r}: give comma-separated token ids, e.g. 1,2,3")
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise SpecbuildError(f"--input-ids {text!r}: give comma-separated integer token ids, e.g. 1,2,3") from None
    if any(i < 0 for i in ids):
        raise SpecbuildError(f"--input-ids {text!r}: token ids must be >= 0")
    return ids


def parse_draft_options(pairs) -> dict:
    """{key: value} of --draft-option KEY=VALUE (values read as YAML scalars: 2, true)."""
    import yaml

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecbuildError(f"--draft-option {pair!r}: expected KEY=VALUE, e.g. window=2")
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            options[key.strip()] = value
    return options


@click.command()
@click.option("--engine-dir", required=True, type=click.Path(path_type=Path), help="Engine directory.")
@click.option("--prompt", help="Prompt text (needs the engine's tokenizer).")
@click.option("--input-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@sampling_options
@click.option("--chat", is_flag=True, help="Wrap the prompt with the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--backend", help=f"One of {', '.join(BACKEND_CHOICES)} (default: tensorrt if the engine has a plan).")
@click.option(
    "--graph",
    help="Which backend's graph to run (default: the backend's own); `--graph tensorrt` runs the portable graph on "
    "ONNX Runtime.",
)
@click.option("--threads", type=int, help="Intra-op threads for ONNX Runtime.")
@click.option("--allow-lossy", is_flag=True, help=ALLOW_LOSSY_HELP)
@click.option(
    "--speculation",
    help="auto (default; or $SPECBUILD_SPECULATION): verify drafts when the measured cost says they pay; always; "
    "off: plain decoding through the engine.",
)
@click.option(
    "--draft-option",
    "draft_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="This request's own drafting setting, where the engine's mode has them (at most the built ones, which "
    "`specbuild inspect` shows under mode settings), e.g. window=2; repeatable.",
)
@click.option(
    "--draft-pool",
    type=click.Path(path_type=Path, file_okay=False),
    help="Keep what drafters that learn from traffic (suffix decoding) learnt in this directory: later runs draft "
    "from this run's output too.",
)
@handle_errors
def run(
    engine_dir,
    prompt,
    input_ids,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    chat,
    as_json,
    backend,
    graph,
    threads,
    allow_lossy,
    speculation,
    draft_options,
    draft_pool,
):
    """Generate from an engine directory."""
    from specbuild.runtime.engine import Engine

    if (prompt is None) == (input_ids is None):
        raise SpecbuildError("give exactly one of --prompt TEXT or --input-ids 1,2,3")
    ids = parse_input_ids(input_ids) if input_ids is not None else None
    if ids is not None and chat:
        raise SpecbuildError("--chat needs --prompt text, not --input-ids")
    if max_new_tokens < 1:
        raise SpecbuildError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_choice("--backend", backend, BACKEND_CHOICES)
    check_choice("--graph", graph, BACKEND_CHOICES)
    sampling = sampling_params(temperature, top_p, top_k, seed)
    engine = Engine(
        engine_dir,
        backend=backend,
        threads=threads,
        graph=graph,
        allow_lossy=allow_lossy,
        speculation=speculation,
        draft_pool=draft_pool,
    )
    if not engine.lossless and engine.manifest.get("lossless", True):
        click.echo(f"warning: this run is LOSSY (--allow-lossy), {engine.exactness.verified}", err=True)
    options = parse_draft_options(draft_options)
    generate_and_print(engine, prompt, ids, max_new_tokens, sampling, chat, as_json, options)
