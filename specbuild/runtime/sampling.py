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


class SamplingError(SpecbuildError):
    """A sampling setting out of range: `field` is the SamplingParams field at fault, the message names it the way
    the caller does (a CLI flag, a request parameter)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass
class SamplingParams:
    """temperature 0 = greedy. top_k 0 and top_p 1 switch those filters off. Same seed -> same output.

    A sampling temperature must be at least MIN_TEMPERATURE (1e-5): the step graph divides the logits by
    max(temperature, 1e-5), so a smaller one would silently act as 1e-5 and is refused instead. `names` says how the
    caller calls each field in an error (e.g. {"top_p": "--top-p"}; default: the field's own name).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    names: dataclasses.InitVar[dict | None] = None

    def __post_init__(self, names):
        def fail(field: str, want: str, value):
            raise SamplingError(field, f"{(names or {}).get(field, field)} must be {want}, got {value!r}")

        t = self.temperature
        if not is_real(t) or not (t == 0 or ef.MIN_TEMPERATURE <= t <= FLOAT32_MAX):
            fail("temperature", f"0 (greedy) or a finite number >= {ef.MIN_TEMPERATURE:g}", t)
        p = self.top_p
        if not is_real(p) or not 0 < p <= 1:  # NaN fails both comparisons
            fail("top_p", "a number in (0, 1] (1 = off)", p)
        if not is_integer(self.top_k) or not 0 <= self.top_k <= ef.MAX_TOP_K:
            fail(
                "top_k",
                f"an integer in [0, {ef.MAX_TOP_K}] (0 = off; the engine's filters work over the {ef.MAX_TOP_K} most "
                "likely tokens)",
                self.top_k,
            )
        if not is_integer(self.seed) or self.seed < 0:
            fail("seed", "an integer >= 0", self.seed)
        self.temperature, self.top_p = float(t), float(p)
        self.top_k, self.seed = int(self.top_k), int(self.seed)


def position_uniforms(seed: int, positions: int) -> np.ndarray:
    """float32 [positions]: the uniform number of each position of a sampled request's sequence, from its seed alone.

    Number q draws the token at position q: every verified node draws its next token by inverse CDF with the number
    of the position that token takes (builder/network/acceptance.py), and a drafter that samples its drafts draws the
    draft for position q with the same number. So the token at each position is the one plain decoding draws there,
    whatever was drafted or batched: a seed means the same tokens."""
    return np.random.default_rng(seed).random(positions, dtype=np.float32)
