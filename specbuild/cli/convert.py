"""`specbuild convert`: a Hugging Face checkpoint and the speculative heads of any mode that has them (the mode
registry lists their `--<mode>-dir` options) into one validated canonical checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors
from specbuild.cli.options import check_choice
from specbuild.modes.registry import head_modes

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")


def head_dir_options(func):
    """`--<mode>-dir DIR` for every mode with heads to convert (from the mode registry)."""
    for mode, spec in reversed(head_modes().items()):
        func = click.option(spec.head_option, _head_param(mode), type=click.Path(path_type=Path), help=spec.heads)(func)
    return func


def _head_param(mode: str) -> str:
    """The click parameter of `mode`'s head directory option."""
    return mode.replace("-", "_") + "_dir"


@click.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Hugging Face model directory.")
@click.option("--output-dir", required=True, type=click.Path(path_type=Path), help="Canonical checkpoint to write.")
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    help=f"One of {', '.join(DTYPE_CHOICES)} (auto: the weights' own dtype, float32 where they mix dtypes).",
)
@head_dir_options
@click.option("--overwrite", is_flag=True, help="Replace a previous specbuild output there (nothing else).")
@handle_errors
@needs_extra("build")
def convert(model_dir, output_dir, dtype, overwrite, **head_dirs):
    """Convert a HF checkpoint (+ speculative heads) into one validated canonical checkpoint."""
    from specbuild.builder.checkpoint.convert import convert_checkpoint
    from specbuild.fsutil import provisional_commits

    check_choice("--dtype", dtype, DTYPE_CHOICES)
    heads = {mode: head_dirs[_head_param(mode)] for mode in head_modes() if head_dirs.get(_head_param(mode))}
    with provisional_commits():  # an interrupt until the command ends still leaves nothing behind
        out = convert_checkpoint(model_dir, output_dir, dtype=dtype, heads=heads or None, overwrite=overwrite)
    click.echo(f"checkpoint written to {out}", err=True)
