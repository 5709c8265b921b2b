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
