"""What a peer stack -- something a user could run instead of our engines -- gives the benchmarks.

A stack is one module of this package with a `STACK` (a `PeerStack`): the `specbuild bench` options that point it at a
model (the CLI is made from them), the checks of their combinations, and its rows: for the one-at-a-time benchmark,
timers with `label`, `ngram` (whether it speculates) and `sample(ids, max_new_tokens, sampling) -> Sample`; under
load, closed-loop targets with `label`, `max_new_tokens`, `submit(ids, sampling)`, `step()`, `finished(request) ->
Finished | None` and `counters()`. Every stack imports its own libraries only when it is used.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from specbuild.bench.results import Finished


@dataclasses.dataclass(frozen=True)
class PeerOption:
    """A `specbuild bench` option of a stack: its flag, the keyword it arrives as, its help; `multiple`: repeatable
    (a list of model directories), else one path."""

    flag: str
    dest: str
    help: str
    multiple: bool = True


class PeerStack:
    """One peer stack (see the module docstring). `extra`: the specbuild extra its options need installed."""

    name = ""
    extra: str | None = None
    options: tuple[PeerOption, ...] = ()

    def given(self, args: dict) -> bool:
        """Whether any of this stack's options was given."""
        return any(args.get(option.dest) for option in self.options)

    def check(self, args: dict, under_load: bool) -> None:
        """A one-line SpecbuildError for a combination of its options this stack cannot run."""

    def sequential(self, args: dict, threads: int | None, eos_ids: set[int]) -> list:
        """Its rows of the one-at-a-time benchmark."""
        return []

    def load(self, args: dict, threads: int | None, max_num_seqs: int, max_new_tokens: int) -> list:
        """Its closed-loop targets under load (none: it has no way to serve several requests)."""
        return []

    def settings(self, args: dict) -> dict:
        """The report's record of its options (paths as text)."""

        def text(value):
            if isinstance(value, (list, tuple)):
                return [str(v) for v in value]
            return str(value) if value else None

        return {option.dest: text(args.get(option.dest)) for option in self.options}


def model_dirs(args: dict, dest: str) -> list[Path]:
    """The directories a repeatable option gave (none: an empty list)."""
    return [Path(d) for d in args.get(dest) or ()]


class StaticBatch:
    """A peer without continuous batching, run as its users batch prompts: the requests waiting when no batch runs
    start together, and the batch runs until every one of them has its tokens (EOS or max_new_tokens); a request
    submitted meanwhile waits for the next batch. Each step makes one token of every row (the first one's includes
    the prompts), read when it is made. Subclasses start a batch (`_start`) and make its next tokens (`_next`); a
    sampled batch draws with the settings of its first request (a static batch has one generator)."""

    def __init__(self, eos: set[int], max_new_tokens: int):
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self._waiting: list[dict] = []
        self._batch: list[dict] = []

    def submit(self, ids: list[int], sampling) -> dict:
        request = {"ids": ids, "out": [], "times": [], "arrival": time.perf_counter(), "done": False}
        request["sampling"] = sampling
        self._waiting.append(request)
        return request

    def step(self) -> bool:
        if not self._batch:
            if not self._waiting:
                return False
            self._batch, self._waiting = self._waiting, []
            self._start(self._batch)
        tokens, now = self._next(), time.perf_counter()
        for request, token in zip(self._batch, tokens):
            if not request["done"]:
                request["out"].append(int(token))
                request["times"].append(now - request["arrival"])
                request["done"] = int(token) in self.eos or len(request["out"]) >= self.max_new_tokens
        if all(r["done"] for r in self._batch):
            self._batch = []
            self._start([])
        return True

    def _start(self, requests: list[dict]) -> None:
        """Set up a batch of `requests` (none: drop the finished batch's state)."""
        raise NotImplementedError

    def _next(self) -> list[int]:
        """The batch's next token, one per row."""
        raise NotImplementedError

    def finished(self, request: dict) -> Finished | None:
        if not request["done"]:
            return None
        times = request["times"]
        return Finished(request["out"], times[0], times[-1], times[-1])

    def counters(self) -> dict[str, int]:
        return {}
