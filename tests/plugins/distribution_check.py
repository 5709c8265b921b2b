"""Exact output distributions of tiny-vocabulary models and a chi-square check of sampled generations."""

import torch
from scipy.stats import chisquare

from tests.builder.network.reference_acceptance import reference_probs


def exact_distribution(model, prompt, n, temperature, top_k, top_p):
    """P(first n generated tokens) by enumerating every sequence (tiny vocabulary)."""
    vocab = model.config.vocab_size
    probs = {(): 1.0}
    for _ in range(n):
        seqs = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1].double().numpy()
        nxt = {}
        for s, row in zip(seqs, logits):
            p = reference_probs(row, temperature, top_k, top_p)
            for tok in range(vocab):
                if p[tok] > 0:
                    nxt[s + (tok,)] = probs[s] * p[tok]
        probs = nxt
    return probs


def chi_square_pvalue(counts: dict, exact: dict, samples: int) -> float:
    """Pearson chi-square of observed sequence counts against exact probabilities (cells with expected < 5 pooled)."""
    big = [s for s, p in exact.items() if p * samples >= 5]
    observed = [counts.get(s, 0) for s in big] + [samples - sum(counts.get(s, 0) for s in big)]
    expected = [exact[s] * samples for s in big] + [samples * (1 - sum(exact[s] for s in big))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    return chisquare(observed, expected).pvalue


def sampled_counts(engine, prompt, n, samples, temperature, top_k, top_p):
    """({generated ids: count}, tokens accepted per step) of `samples` seeded generations of n tokens, run as one
    queue through the engine's scheduler: in-flight batches of its slots (a seed gives its batch-1 tokens in any
    batch: tests/runtime/test_scheduler.py), so every sample costs a row of a call instead of calls of its own."""
    from specbuild.runtime.engine import SamplingParams
    from specbuild.runtime.scheduler import Request

    scheduler = engine.scheduler
    handles = [
        scheduler.submit(Request(list(prompt), n, SamplingParams(temperature, top_k, top_p, seed)))
        for seed in range(samples)
    ]
    scheduler.run_until_idle()
    counts: dict = {}
    steps: list = []
    for handle in handles:
        assert handle.error is None, handle.error
        counts[tuple(handle.output_ids)] = counts.get(tuple(handle.output_ids), 0) + 1
        steps += handle.accepted_per_step
    return counts, steps


def check_sampled_distribution(engine, prompt, n, samples, exact, temperature, top_k, top_p) -> None:
    """Seeded samples of `engine` follow `exact` (chi-square), drafts were accepted, and a seed repeats its output."""
    from specbuild.runtime.engine import SamplingParams

    counts, steps = sampled_counts(engine, prompt, n, samples, temperature, top_k, top_p)
    assert set(counts) <= set(exact)
    assert chi_square_pvalue(counts, exact, samples) > 1e-3
    assert max(steps) > 1  # drafts were accepted
    same = SamplingParams(temperature, top_k, top_p, 7)
    first = engine.generate(input_ids=prompt, max_new_tokens=n, sampling=same)
    assert engine.generate(input_ids=prompt, max_new_tokens=n, sampling=same).output_ids == first.output_ids
