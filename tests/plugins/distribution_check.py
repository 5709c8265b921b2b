"""Exact output distributions of tiny-vocabulary models and a chi-square check of sampled generations."""

import torch
from scipy.stats import chisquare

from tests.builder.reference_acceptance import reference_probs


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
