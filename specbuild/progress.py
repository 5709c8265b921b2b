"""Progress of long work (convert, export, quantization, validation of large models): never silent for long.

`steps(description, total)` yields advance(): on a terminal a rich progress bar with the count and elapsed time; in a
log (stderr not a terminal) a line every LOG_EVERY_S seconds while it runs and one when it ends, each with the count
and the elapsed time; work that ends sooner says nothing (a failure's one-line error stays alone).
`waiting(description)` covers one long call that counts nothing (torch.export's trace): a line every LOG_EVERY_S
seconds while it runs, from a thread of its own, and one when it ends, with the elapsed time.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

LOG_EVERY_S = 5.0


@contextlib.contextmanager
def steps(description: str, total: int, enabled: bool = True, log=None):
    """Yield advance(n=1) over `total` units of `description`. log: where log lines go (default stderr)."""
    if not enabled or total <= 0:
        yield lambda n=1: None
        return
    if log is None and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)
        return
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    started = last = time.perf_counter()
    done = 0

    def advance(n: int = 1) -> None:
        nonlocal done, last
        done += n
        now = time.perf_counter()
        if now - last >= LOG_EVERY_S and done < total:
            log(f"{description}: {done}/{total} ({now - started:.0f} s)")
            last = now

    yield advance
    if last > started:  # it said something while running: say that it ended
        log(f"{description}: {done}/{total} in {time.perf_counter() - started:.1f} s")


@contextlib.contextmanager
def waiting(description: str, log=None):
    """Within: one long call that reports no steps; `description` and the elapsed time said every LOG_EVERY_S seconds
    while it runs (lines, a terminal's progress bar of other work may be live) and once when it ends, if it said
    anything. log: where the lines go (default stderr)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    started, ended = time.perf_counter(), threading.Event()
    said = []

    def tick() -> None:
        while not ended.wait(LOG_EVERY_S):
            said.append(True)
            log(f"{description} ({time.perf_counter() - started:.0f} s)")

    ticker = threading.Thread(target=tick, name="specbuild-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        ended.set()
        ticker.join()
    if said:
        log(f"{description}: done in {time.perf_counter() - started:.1f} s")
