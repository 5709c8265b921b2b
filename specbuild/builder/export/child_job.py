"""One function run in a spawned child process while the caller goes on: its result, its error, or its end.

The build runs the call-by-call check of a large quantized graph (a trace of its own, single-threaded for most of
its time) on the second core while the first traces and writes the graph itself. Spawned, not forked: the parent
holds thread pools (torch's, ONNX Runtime's) that a forked child would inherit locked.
"""

from __future__ import annotations

import multiprocessing
import traceback

from specbuild.errors import SpecbuildError


class ChildJob:
    """`fn(*args)` in a child process started now; `result()` waits for it, `cancel()` ends it. Use as a context
    manager: leaving it ends the child if it still runs (the caller failed before it asked for the result)."""

    def __init__(self, what: str, fn, *args):
        context = multiprocessing.get_context("spawn")
        self.what = what
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_run, args=(sender, fn, args), daemon=True)
        self._process.start()
        sender.close()  # the child holds the only sender: its end is EOF here

    def result(self):
        """fn's return value; fn's exception raised here (a SpecbuildError as it was, any other with the child's
        traceback in its message)."""
        try:
            ok, value = self._results.recv()
        except EOFError:
            self._process.join()
            raise SpecbuildError(f"{self.what}: its process ended without a result (exit code "
                                 f"{self._process.exitcode})") from None  # fmt: skip
        finally:
            self._results.close()
        self._process.join()
        if ok:
            return value
        raise value

    def cancel(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()

    def __enter__(self) -> ChildJob:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.cancel()


def _run(sender, fn, args) -> None:
    try:
        outcome = (True, fn(*args))
    except SpecbuildError as exc:
        outcome = (False, exc)
    except BaseException as exc:  # noqa: BLE001  (any failure goes back to the parent, with where it happened)
        outcome = (False, RuntimeError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    sender.send(outcome)
    sender.close()
