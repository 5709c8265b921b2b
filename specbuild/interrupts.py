"""SIGINT and SIGTERM during a command: raised as exceptions in the main thread, remembered, never lost.

`handling_interrupts` (the CLI, main thread) turns SIGINT into KeyboardInterrupt and SIGTERM into `Terminated`, and
remembers the signal: `check_interrupted()` raises it again at stage boundaries and right before a commit, so an
interrupt swallowed by library code (a weakref callback, a __del__) still aborts the run before anything is
written; it is also re-raised every REARM_S seconds until some cleanup handler has taken it (`mark_handled`).
`INTERRUPTS.deferred()` only records signals inside a block (a commit, a cleanup: a second Ctrl-C never interrupts
it). The CLI exits 128 + the signal number (130, 143).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

REARM_S = 1.0  # a swallowed interrupt is raised again after this many seconds


class Terminated(BaseException):
    """Raised in the main thread when SIGTERM arrives while the CLI handles signals (exit code 143)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


class _Interrupts:
    """The first signal received, whether a cleanup handler has taken it, and the defer depth."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.signum: int | None = None
        self.handled = False
        self.defer = 0
        self.aborted: list[str] = []  # outputs a cleanup discarded (named in the CLI's message)

    def exception(self) -> BaseException:
        return KeyboardInterrupt() if self.signum == signal.SIGINT else Terminated(self.signum)

    def on_signal(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            _set_timer(REARM_S)
        elif self.handled:
            return  # a second Ctrl-C during cleanup: ignored, the run is ending anyway
        if not self.defer:
            raise self.exception()

    def on_alarm(self, _signum, _frame) -> None:
        if self.signum is None or self.handled:
            _set_timer(0)
        elif not self.defer:
            raise self.exception()  # the first one was swallowed somewhere: raise it again

    def mark_handled(self) -> None:
        """A cleanup handler has the interrupt: stop re-raising it."""
        if self.signum is not None and not self.handled:
            self.handled = True
            _set_timer(0)

    def check(self) -> None:
        if self.signum is not None and not self.handled:
            raise self.exception()

    @contextlib.contextmanager
    def deferred(self):
        """Signals arriving inside the block are only recorded (raise them later with check())."""
        self.defer += 1
        try:
            yield
        finally:
            self.defer -= 1


INTERRUPTS = _Interrupts()
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _set_timer(seconds: float) -> None:
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        signal.setitimer(signal.ITIMER_REAL, seconds, seconds)


def check_interrupted() -> None:
    """Raise the interrupt received earlier (if any, and not yet being handled): call at stage boundaries."""
    INTERRUPTS.check()


@contextlib.contextmanager
def handling_interrupts():
    """SIGINT -> KeyboardInterrupt, SIGTERM -> Terminated, remembered in INTERRUPTS (main thread only; restored)."""
    if threading.current_thread() is not threading.main_thread():
        yield INTERRUPTS
        return
    signums = (*_HANDLED_SIGNALS, signal.SIGALRM) if hasattr(signal, "SIGALRM") else _HANDLED_SIGNALS
    previous = {s: signal.getsignal(s) for s in signums}
    previous_hook = sys.unraisablehook

    def unraisable(info):  # an interrupt raised inside a weakref callback or __del__: re-raised later, not printed
        if not (INTERRUPTS.signum is not None and isinstance(info.exc_value, (KeyboardInterrupt, Terminated))):
            previous_hook(info)

    INTERRUPTS.reset()
    try:
        for s in _HANDLED_SIGNALS:
            signal.signal(s, INTERRUPTS.on_signal)
        if hasattr(signal, "SIGALRM"):
            signal.signal(signal.SIGALRM, INTERRUPTS.on_alarm)
        sys.unraisablehook = unraisable
        yield INTERRUPTS
    finally:
        _set_timer(0)
        sys.unraisablehook = previous_hook
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        INTERRUPTS.reset()


def interruption_message(signum: int) -> str:
    """`interrupted (SIGINT); <output> was not written` (the output part when a run was discarded)."""
    text = f"interrupted ({signal.Signals(signum).name})"
    if INTERRUPTS.aborted:
        text += f"; {' and '.join(dict.fromkeys(INTERRUPTS.aborted))} was not written"
    return text
