"""`specbuild train`: speculative heads trained by self-distillation as a recipe describes (extra specbuild[train]);
the recipe's `kind` names the mode whose trainer runs it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specbuild.cli.extras import needs_extra
from specbuild.cli.handling import handle_errors
from specbuild.errors import SpecbuildError


@click.command()
@click.option(
    "--recipe",
    required=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Training recipe (recipes/train-*-smollm2.yaml).",
)
@click.option(
    "--device",
    default=None,
    help="Where data generation and training run: cuda or cpu (default: cuda when torch sees a GPU).",
)
@click.option(
    "--corpus-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Train on teacher-forced features of this corpus (the recipe's `corpus_dir`), not on the data stage's.",
)
@click.option("--max-sequences", type=int, help="Only the first N sequences of the corpus (`corpus.max_sequences`).")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe key (dotted, YAML value), e.g. --set train.time_budget_s=300; repeatable.",
)
@click.option(
    "--choose-only",
    is_flag=True,
    help="Only the recipe's `choose` stage: measure its candidate build settings with the heads already in its "
    "output_dir (--set output_dir=DIR for others) on this machine and record the fastest as their defaults.",
)
@handle_errors
@needs_extra("train")
def train(recipe, device, corpus_dir, max_sequences, overrides, choose_only):
    """Train speculative heads for a base model by self-distillation, as a recipe describes.

    The recipe's `kind` names the mode whose trainer runs it (see recipes/train-*-smollm2.yaml). The same recipe
    runs on a CUDA GPU or on the CPU; with a corpus (recipes/train-*-corpus.yaml or --corpus-dir) the features are
    recomputed from its token ids by teacher forcing.
    """
    from specbuild.training.recipe import run_recipe

    if max_sequences is not None and max_sequences <= 0:
        raise SpecbuildError(f"--max-sequences {max_sequences}: must be > 0")
    overrides = list(overrides)
    if corpus_dir is not None:
        overrides.append(f"corpus_dir={corpus_dir}")
    if max_sequences is not None:
        overrides.append(f"corpus.max_sequences={max_sequences}")
    metrics = run_recipe(recipe, device=device, overrides=overrides, choose_only=choose_only)
    click.echo(json.dumps(metrics, indent=2, default=str))
