"""How a benchmark decodes: greedy, or sampled with the run's temperature, top-k, top-p and seed (`specbuild bench
--temperature ...`), the same settings given to every engine and peer in each one's own terms.

Request i of a run (the i-th prompt) is seeded with seed + i: each prompt has a stream of its own, and the same one
in every engine, at every concurrency and in every round, so that a speculative engine's sampled output can be
compared token for token with its `none` engine's (a seed gives the same tokens whatever was drafted).
"""

from __future__ import annotations

import dataclasses

from specbuild.runtime.sampling import SamplingParams


def is_greedy(sampling: SamplingParams | None) -> bool:
    return sampling is None or sampling.temperature <= 0


def for_request(sampling: SamplingParams | None, index: int) -> SamplingParams:
    """Request `index`'s settings: greedy, or the run's with seed + index."""
    if is_greedy(sampling):
        return SamplingParams()
    return dataclasses.replace(sampling, seed=sampling.seed + index)


def to_dict(sampling: SamplingParams | None) -> dict | None:
    """The report's record of the settings (None: greedy)."""
    if is_greedy(sampling):
        return None
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "seed": sampling.seed}  # fmt: skip


def describe(record: dict | None) -> str:
    """A report's record (`to_dict`) for its titles: 'greedy', or e.g. 'sampled (T 0.7, top-p 0.9, seed 0)'."""
    if not record:
        return "greedy"
    filters = [f"top-k {record['top_k']}"] if record["top_k"] else []
    filters += [f"top-p {record['top_p']:g}"] if record["top_p"] < 1 else []
    seed = f"seed {record['seed']}"
    return f"sampled (T {record['temperature']:g}, {', '.join([*filters, seed])})"


def hf_generate_kwargs(sampling: SamplingParams) -> dict:
    """transformers' `generate` arguments (seed it with torch.manual_seed(sampling.seed) before the call)."""
    if is_greedy(sampling):
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p}  # fmt: skip


def genai_search_options(sampling: SamplingParams) -> dict:
    """ONNX Runtime GenAI's `set_search_options` arguments (its top_k 0 is off, as ours)."""
    if is_greedy(sampling):
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "random_seed": sampling.seed}  # fmt: skip


def set_openvino(config, sampling: SamplingParams) -> None:
    """OpenVINO GenAI's GenerationConfig for these settings (its top_k is off unless set)."""
    config.do_sample = not is_greedy(sampling)
    if config.do_sample:
        config.temperature, config.top_p, config.rng_seed = sampling.temperature, sampling.top_p, sampling.seed
        if sampling.top_k:
            config.top_k = sampling.top_k


def hf_sampler(sampling: SamplingParams):
    """(logits [B,V] -> tokens [B]) for a hand-written transformers loop: argmax, or a draw after transformers' own
    temperature, top-k and top-p warpers from a torch generator seeded with the seed."""
    import torch

    if is_greedy(sampling):
        return lambda logits: logits.argmax(-1)
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    generator = torch.Generator().manual_seed(sampling.seed)

    def pick(logits):
        probs = torch.softmax(warpers(None, logits.float()), dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    return pick
