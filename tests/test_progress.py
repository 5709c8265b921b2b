"""Progress of long work: counted steps and one long call say where they are every LOG_EVERY_S seconds in a log, and
that they ended; work that ends sooner says nothing."""

import time

import pytest

from specbuild import progress


@pytest.fixture
def often(monkeypatch):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.05)


def test_steps_say_their_count_while_they_run_and_when_they_end(often):
    lines = []
    with progress.steps("writing", 4, log=lines.append) as done:
        for _ in range(4):
            time.sleep(0.06)
            done()
    assert lines[0].startswith("writing: 1/4 (") and lines[-1].startswith("writing: 4/4 in ")
    quiet = []
    with progress.steps("writing", 4, log=quiet.append) as done:
        done(4)
    assert quiet == []


def test_a_long_call_is_never_silent_and_a_short_one_says_nothing(often):
    lines = []
    with progress.waiting("tracing the none step graph", log=lines.append):
        time.sleep(0.3)
    assert len(lines) >= 3 and lines[0].startswith("tracing the none step graph (")
    assert lines[-1].startswith("tracing the none step graph: done in ")
    quiet = []
    with progress.waiting("tracing", log=quiet.append):
        pass
    assert quiet == []
    failed = []
    with pytest.raises(RuntimeError), progress.waiting("tracing", log=failed.append):
        time.sleep(0.12)
        raise RuntimeError("the trace failed")
    assert failed and not any("done" in line for line in failed)  # the error reports the end
