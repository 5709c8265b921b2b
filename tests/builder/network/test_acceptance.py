"""In-graph acceptance (torch module) against the plain sequential references on thousands of random trees."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specbuild.builder.network.acceptance import accept
from specbuild.tree import Tree
from tests.builder.network.reference_acceptance import reference_accept
from tests.tiers import full


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


@settings(max_examples=300, deadline=None)
@given(trees_and_logits())
def test_accept_matches_sequential_reference(case):
    _assert_accept_matches_reference(case)


@full("2000 more random trees and logits (the fast tier draws 300)")
@settings(max_examples=2000, deadline=None)
@given(trees_and_logits())
def test_accept_matches_sequential_reference_on_many_trees(case):
    _assert_accept_matches_reference(case)


def _assert_accept_matches_reference(case) -> None:
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


def test_the_drafts_never_change_the_sampled_tokens():
    """With each position's uniform fixed, whatever tree is verified (or none) the accepted tokens are the prefix of
    the tokens plain sampling draws: the output does not depend on what was drafted."""
    rng = np.random.default_rng(1)
    tree = Tree.from_choices([[0], [1], [0, 0], [1, 0], [1, 1]])
    vocab = 6
    for _ in range(200):
        chain_logits = rng.normal(size=(4, vocab)).astype(np.float32) * 2  # the model after each true prefix
        u = rng.random(4).astype(np.float32)  # one uniform per output position
        plain = []  # what plain decoding samples at each position: one root per call
        for d in range(4):
            root = Tree.from_choices([])
            plain += run_accept(root, chain_logits[d : d + 1], np.array([0]), 1.0, 0, 1.0, u[d : d + 1], 0.5)[0]
        # a tree whose first path may follow the sampled tokens: node logits are the chain's at the same depth
        tokens = rng.integers(vocab, size=tree.size)
        if rng.random() < 0.5:
            tokens[1] = plain[0]
        logits = chain_logits[tree.depths]
        acc, _ = run_accept(tree, logits, tokens, 1.0, 0, 1.0, u[tree.depths], 0.5)
        assert list(acc) == plain[: len(acc)]


def test_top_token_is_the_first_argmax_in_an_exported_graph(tmp_path):
    """The exported argmax is a TopK (k = 1); ONNX Runtime must pick the first of equal maxima, as argmax does."""
    import onnx
    import onnxruntime as ort

    from specbuild.builder.export.exporter import OPSET
    from specbuild.builder.network.acceptance import top_token

    class Top(torch.nn.Module):
        def forward(self, x):
            return top_token(x)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 4096)).astype(np.float32)
    for row, cols in enumerate([(7, 3000), (4095, 4094), (0, 1, 2)]):
        x[row, 1, list(cols)] = 9.0  # ties for the maximum
    x[2, 3, :] = 1.5  # all equal
    path = tmp_path / "top.onnx"
    torch.onnx.export(Top().eval(), (torch.from_numpy(x),), dynamo=True, opset_version=OPSET).save(str(path))
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "TopK" in ops and "ArgMax" not in ops
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, x.argmax(-1))
    np.testing.assert_array_equal(top_token(torch.from_numpy(x)).numpy(), x.argmax(-1))
    assert got[0, 1] == 7 and got[1, 1] == 4094 and got[2, 1] == 0 and got[2, 3] == 0


def test_branch_exports_one_if_and_keeps_the_outputs_structure(tmp_path):
    """`branch` (torch.cond without the torch.compile pass): eagerly one branch runs; exported, an ONNX If whose
    outputs come back as the branch returned them (one tensor, or a tuple)."""
    import onnx
    import onnxruntime as ort

    from specbuild.builder.export.exporter import OPSET
    from specbuild.builder.network.acceptance import branch

    def twice(x, y):
        return x * 2.0, (y + 1).sum(-1)

    def negated(x, y):
        return -x, y.sum(-1)

    def largest(x, y):
        return x.max(-1).values

    def smallest(x, y):
        return x.min(-1).values

    class Branches(torch.nn.Module):
        def forward(self, x, y):
            pair = branch((x.sum() > 0), twice, negated, (x, y))
            return (*pair, branch((y > 2).any(), largest, smallest, (x, y)))

    x, y = torch.randn(2, 3), torch.arange(6).view(2, 3)
    path = tmp_path / "branches.onnx"
    torch.onnx.export(Branches().eval(), (x, y), dynamo=True, opset_version=OPSET, input_names=["x", "y"]).save(
        str(path)
    )
    assert [n.op_type for n in onnx.load(str(path)).graph.node].count("If") == 2
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sign, offset in ((1.0, 0), (-1.0, 0), (1.0, -5)):
        xs, ys = sign * x.abs(), y + offset
        want = Branches()(xs, ys)
        got = session.run(None, {"x": xs.numpy(), "y": ys.numpy()})
        assert len(got) == 3
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w.numpy())
    assert torch.equal(Branches()(x.abs(), y)[0], 2.0 * x.abs())  # eager: the taken branch only
