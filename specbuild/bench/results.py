"""What one measured generation gives, whoever ran it (our engines or a peer): a `Sample` of the one-at-a-time
benchmark, a `Finished` request of a closed loop under load."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Sample:
    """One timed generation."""

    output_ids: list[int]
    steps: int
    accepted: int  # tokens accepted over all decode steps (bonus included)
    total_s: float
    ttft_s: float
    decode_engine_s: float  # engine time of the decode steps (prefill excluded)

    @property
    def tokens(self) -> int:
        return len(self.output_ids)

    @property
    def decode_s(self) -> float:
        return max(self.total_s - self.ttft_s, 0.0)

    @property
    def decode_host_s(self) -> float:
        return max(self.decode_s - self.decode_engine_s, 0.0)


@dataclasses.dataclass
class Finished:
    """One finished request of a closed loop; times in seconds after its submission."""

    output_ids: list[int]
    ttft_s: float
    last_token_s: float
    latency_s: float
    accepted_per_step: list[int] = dataclasses.field(default_factory=list)
    prefill_engine_s: float | None = None  # engine time of its prompt (our engines only)

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency (None for a request of one token)."""
        n = len(self.output_ids)
        return (self.last_token_s - self.ttft_s) / (n - 1) if n > 1 else None
