"""In-graph acceptance (torch module) against the plain sequential reference on thousands of random trees."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbuild.builder.acceptance import accept
from specbuild.tree import Tree
from tests.builder.reference_acceptance import reference_accept


@st.composite
def trees_and_logits(draw):
    vocab = draw(st.integers(2, 12))
    choices = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=12))
    closed = {tuple(c[:i]) for c in choices for i in range(1, len(c) + 1)}
    tree = Tree.from_choices([list(c) for c in closed])
    n = tree.size
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.5, 2.0, 6.0]))
    logits = rng.normal(size=(n, vocab)) * scale
    # draft tokens: distinct among siblings (as top-k drafts are); often the argmax so paths get accepted
    tokens = np.zeros(n, dtype=np.int64)
    for parent in range(n):
        kids = [c for c in range(n) if tree.parents[c] == parent]
        order = list(np.argsort(-logits[parent]))
        if rng.random() < 0.3:
            rng.shuffle(order)
        for i, c in enumerate(kids):
            tokens[c] = order[i % vocab]
    tokens[0] = rng.integers(vocab)
    temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1.5]))
    top_k = draw(st.sampled_from([0, 0, 2, 5]))
    top_p = draw(st.sampled_from([1.0, 1.0, 0.9, 0.5]))
    return (
        tree,
        logits.astype(np.float32),
        tokens,
        temperature,
        top_k,
        top_p,
        rng.random(n).astype(np.float32),
        np.float32(rng.random()),
    )


def run_accept(tree, logits, tokens, temperature, top_k, top_p, ra, rs):
    t = lambda a, dt=torch.float32: torch.tensor(np.asarray(a), dtype=dt).unsqueeze(0)  # noqa: E731
    out = accept(
        t(logits),
        t(tokens, torch.int64),
        t(tree.ancestor_mask, torch.bool),
        t(tree.paths, torch.int64),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        t(ra),
        torch.tensor([rs]),
    )
    acc_tokens, num, nodes, _ = (x[0].numpy() for x in out)
    n = int(num)
    return acc_tokens[:n].tolist(), nodes[:n].tolist()


@settings(max_examples=2000, deadline=None)
@given(trees_and_logits())
def test_accept_matches_sequential_reference(case):
    tree, logits, tokens, temperature, top_k, top_p, ra, rs = case
    got_tokens, got_nodes = run_accept(tree, logits, tokens, temperature, top_k, top_p, ra, rs)
    want_tokens, want_nodes = reference_accept(logits, tokens, tree.parents, temperature, top_k, top_p, ra, rs)
    assert got_nodes == want_nodes
    assert got_tokens == want_tokens


def test_greedy_accepts_longest_matching_path_and_first_wins_ties():
    # root -> two children; both children are the argmax? siblings are distinct, so only one can match
    tree = Tree.from_choices([[0], [1], [0, 0], [1, 0]])
    logits = np.full((5, 6), -5.0, dtype=np.float32)
    logits[0, 3] = 5  # root predicts 3
    logits[1, 4] = 5  # node [0] (token 3) predicts 4
    logits[3, 2] = 5  # node [0,0] predicts 2 (bonus)
    tokens = np.array([1, 3, 5, 4, 4])
    acc, nodes = run_accept(tree, logits, tokens, 0.0, 0, 1.0, np.zeros(5, np.float32), np.float32(0.5))
    assert nodes == [0, 1, 3] and acc == [3, 4, 2]
    # nothing matches: only the bonus (argmax of the root) is produced
    tokens = np.array([1, 0, 1, 0, 0])
    acc, nodes = run_accept(tree, logits, tokens, 0.0, 0, 1.0, np.zeros(5, np.float32), np.float32(0.5))
    assert nodes == [0] and acc == [3]
