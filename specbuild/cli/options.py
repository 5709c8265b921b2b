"""Click parameter helpers the `specbuild` commands share.

A value outside an option's choices is one line `error: <message>` and exit 1 (OneLineChoice, check_choice), like
every other CLI error; the --speculative-mode choice comes from the mode registry.
"""

from __future__ import annotations

import click

from specbuild.errors import SpecbuildError
from specbuild.modes.registry import mode_names

ALLOW_LOSSY_HELP = (
    "Run a speculative engine that cannot reproduce its none engine on this CPU (int8 activations on kernels that "
    "no padding makes row-invariant) labelled lossy, instead of refusing it."
)


class OneLineChoiceError(click.ClickException):
    """A bad choice, shown as `error: <message>` (one line, exit 1) like every other CLI error."""

    def show(self, file=None):
        click.echo(f"error: {self.format_message()}", err=True)


class OneLineChoice(click.Choice):
    """click.Choice (`--help` lists the choices) whose bad value is a one-line error instead of a usage message."""

    def convert(self, value, param, ctx):
        if value in self.choices:
            return value
        option = param.opts[0] if param else "value"
        raise OneLineChoiceError(f"{option} {value!r} is not one of {', '.join(self.choices)}")


def check_choice(option: str, value: str | None, choices) -> None:
    """A SpecbuildError when `value` is given and not one of `choices` (for options whose help says the choices)."""
    if value is not None and value not in choices:
        raise SpecbuildError(f"{option} {value!r} is not one of {', '.join(choices)}")


def mode_choice() -> OneLineChoice:
    """The --speculative-mode choice: every mode of the registry."""
    return OneLineChoice(mode_names())


def sampling_options(command):
    """--temperature, --top-p, --top-k and --seed on a command (its function takes them as keyword arguments; turn
    them into a checked SamplingParams with `sampling_params`)."""
    for option in reversed(
        [
            click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy; else >= 1e-5."),
            click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off."),
            click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
            click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampled tokens."),
        ]
    ):
        command = option(command)
    return command


def sampling_params(temperature: float, top_p: float, top_k: int, seed: int):
    """The SamplingParams the sampling options give, checked; an error names the flag (--top-p, ...)."""
    from specbuild.runtime.sampling import SamplingParams

    flags = {name: "--" + name.replace("_", "-") for name in ("temperature", "top_p", "top_k", "seed")}
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, names=flags)
