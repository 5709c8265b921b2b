"""A request's sampling settings, checked once: temperature (0 = greedy), top-k, top-p and the seed of its random
numbers."""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError

FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """temperature 0 = greedy. top_k 0 and top_p 1 switch those filters off. Same seed -> same output.

    A sampling temperature must be at least MIN_TEMPERATURE (1e-5): the step graph divides the logits by
    max(temperature, 1e-5), so a smaller one would silently act as 1e-5 and is refused instead.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t = self.temperature
        if not is_real(t) or not (t == 0 or ef.MIN_TEMPERATURE <= t <= FLOAT32_MAX):
            raise SpecbuildError(
                f"--temperature must be 0 (greedy) or a finite number >= {ef.MIN_TEMPERATURE:g}, got {t!r}"
            )
        p = self.top_p
        if not is_real(p) or not 0 < p <= 1:  # NaN fails both comparisons
            raise SpecbuildError(f"--top-p must be a number in (0, 1] (1 = off), got {p!r}")
        if not is_integer(self.top_k) or not 0 <= self.top_k <= ef.MAX_TOP_K:
            raise SpecbuildError(
                f"--top-k must be an integer in [0, {ef.MAX_TOP_K}] (0 = off; the engine's filters work over the "
                f"{ef.MAX_TOP_K} most likely tokens), got {self.top_k!r}"
            )
        if not is_integer(self.seed) or self.seed < 0:
            raise SpecbuildError(f"--seed must be an integer >= 0, got {self.seed!r}")
        self.temperature, self.top_p = float(t), float(p)
        self.top_k, self.seed = int(self.top_k), int(self.seed)
