"""The error handling every `specbuild` command shares: a SpecbuildError or OSError is one line `error: ...` and
exit 1; an interrupt (SIGINT, SIGTERM) exits 128 + its number."""

from __future__ import annotations

import functools
import signal
import sys

import click

from specbuild.errors import SpecbuildError


def handle_errors(func):
    """Print a SpecbuildError or an OSError as `error: <message>` (one line) on stderr and exit 1.

    SIGINT and SIGTERM raise KeyboardInterrupt / interrupts.Terminated in the main thread while the command runs; any
    exception after one of them (even one an interrupt turned into) prints `error: interrupted (SIGINT)...` and
    exits 128 + the signal number (130, 143). Outputs are discarded by fsutil's cleanup on the way out.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from specbuild import interrupts as signals
        from specbuild.errors import describe_os_error

        with signals.handling_interrupts() as interrupts:
            try:
                return func(*args, **kwargs)
            except BaseException as exc:
                if interrupts.signum is not None or isinstance(exc, (KeyboardInterrupt, signals.Terminated)):
                    interrupts.mark_handled()
                    signum = interrupts.signum or getattr(exc, "signum", signal.SIGINT)
                    click.echo(f"error: {signals.interruption_message(signum)}", err=True)
                    sys.exit(128 + signum)
                if isinstance(exc, SpecbuildError):
                    click.echo(f"error: {exc}", err=True)
                    sys.exit(1)
                if isinstance(exc, OSError):  # a safety net: prefer a specific SpecbuildError at the source
                    click.echo(f"error: {describe_os_error(exc)}", err=True)
                    sys.exit(1)
                raise

    return wrapper
