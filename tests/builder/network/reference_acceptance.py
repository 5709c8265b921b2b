"""Plain, sequential references of tree acceptance: the position-coupled rule the step graph runs (each node's next
token drawn by inverse CDF with its position's uniform; a child is accepted when it is that token) and SpecInfer's
recursive rejection of point-mass drafts, which accepts the same tokens at the same rate."""

from __future__ import annotations

import numpy as np


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Processed distribution of one logits row: temperature -> top-k -> top-p (one-hot argmax at T=0)."""
    v = logits.shape[-1]
    if temperature <= 0:
        p = np.zeros(v)
        p[int(np.argmax(logits))] = 1.0
        return p
    x = logits.astype(np.float64) / max(temperature, 1e-5)
    if top_k > 0 or top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        k = top_k if top_k > 0 else v
        kth = x[order[min(k, v) - 1]]
        x = np.where(x < kth, -np.inf, x)
        sx = x[order]
        sp = np.exp(sx - sx[0])
        sp /= sp.sum()
        before = np.cumsum(sp) - sp
        n_keep = max(1, int((before < top_p).sum()))
        x = np.where(x < sx[n_keep - 1], -np.inf, x)
    p = np.exp(x - x.max())
    return p / p.sum()


def reference_accept(logits, tokens, parents, temperature, top_k, top_p, rand_accept, rand_sample=None):
    """Walk the tree from the root: y = the token node's distribution gives at uniform rand_accept[node]; the child
    holding y continues the walk, else y is the bonus. Returns (accepted tokens incl. bonus, accepted node indices).
    """
    n = len(tokens)
    node, nodes, out = 0, [0], []
    while True:
        p = reference_probs(logits[node], temperature, top_k, top_p)
        cdf = np.cumsum(p)
        y = min(int((cdf <= rand_accept[node] * cdf[-1]).sum()), len(p) - 1)
        out.append(y)
        child = next((c for c in range(n) if parents[c] == node and tokens[c] == y), None)
        if child is None:
            return out, nodes
        nodes.append(child)
        node = child


def reference_accept_rejection(logits, tokens, parents, temperature, top_k, top_p, rand_accept, rand_sample):
    """SpecInfer's recursive rejection with point-mass drafts. Returns (accepted tokens incl. bonus, node indices)."""
    n = len(tokens)
    children = {i: [c for c in range(n) if parents[c] == i] for i in range(n)}
    node, nodes, out = 0, [0], []
    while True:
        p = reference_probs(logits[node], temperature, top_k, top_p)
        residual = p.copy()
        chosen = None
        for c in children[node]:
            tok = tokens[c]
            mass = residual.sum()
            q = residual[tok] / mass if mass > 0 else 0.0
            if rand_accept[c] < q:
                chosen = c
                break
            residual[tok] = 0.0
        if chosen is None:
            total = residual.sum()
            if total <= 0:
                bonus = int(np.argmax(p))
            else:
                cdf = np.cumsum(residual)
                bonus = min(int((cdf <= rand_sample * total).sum()), len(p) - 1)
            out.append(bonus)
            return out, nodes
        out.append(int(tokens[chosen]))
        nodes.append(chosen)
        node = chosen
