"""Token recycling: the static tree (best first, prefix-closed, within its width and depth), the candidate table
filled from every verified row (and a prefill's last rows), each step's tree read from it (a node without candidates
left out with its subtree), a table per tenant, exact greedy ids on tiny models of every shape while the table warms,
the base distribution when sampling, and bad settings refused before any work."""

import numpy as np
import pytest

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.errors import SpecbuildError
from specbuild.plugins.recycle import RANK_PROFILE, static_tree
from specbuild.plugins.recycle.drafter import RecycleDrafter, _graft
from specbuild.runtime.drafter import Proposal, StepResult
from specbuild.runtime.engine import Engine
from specbuild.tree import Tree
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.plugins.host_mode_helpers import check_mode_sampling, toy_engines
from tests.shapes import TINY_SHAPES
from tests.tiers import fast_first

pytestmark = pytest.mark.xdist_group("recycle")

PROMPTS = [[1, 5, 9, 3, 7, 5, 9, 3], [1, 4], [1, 11, 10, 6, 2, 8, 3, 11, 10]]
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def settings(choices=TREE, top_k=2, vocab=32, context=None, copy=None):
    fields = {"top_k": top_k, "depth": max(map(len, choices)), "choices": choices}
    if context is not None:  # engines built before the key existed have none: "token"
        fields["context"] = context
    if copy is not None:  # engines built before the key existed have none: no copies
        fields["copy"] = copy
    return RecycleDrafter.read_settings({"model": {"vocab_size": vocab}, "mode": {"drafter": fields}})


def step(tokens, top=None, prefill=False):
    """A StepResult that accepted `tokens`; top: each verified row's candidates (ef.ROW_TOP_K)."""
    outputs = {} if top is None else {ef.ROW_TOP_K: np.asarray([top], dtype=np.int64)}
    return StepResult(list(tokens), None if prefill else np.zeros(len(tokens), dtype=np.int64), outputs)


def value(choice):
    return np.prod([RANK_PROFILE[min(r, len(RANK_PROFILE) - 1)] for r in choice])


@pytest.mark.parametrize("drafts,k,depth", [(1, 8, 8), (24, 8, 8), (80, 8, 6), (30, 2, 3), (5, 1, 9)])
def test_the_static_tree_takes_the_most_probable_choices_within_its_bounds(drafts, k, depth):
    tree = static_tree(drafts, k, depth)
    assert len(tree) == min(drafts, sum(k**d for d in range(1, depth + 1)))
    assert len(set(tree)) == len(tree)
    assert all(c[:-1] in tree or len(c) == 1 for c in tree)  # prefix-closed
    assert all(len(c) <= depth and max(c) < k for c in tree)
    values = [value(c) for c in tree]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))  # best first (equal values in any order)
    # no choice left out is worth more than the worst one taken (among those within the bounds)
    outside = [c + (r,) for c in [(), *tree] for r in range(k) if len(c) < depth and c + (r,) not in tree]
    assert all(value(c) <= min(values) + 1e-12 for c in outside)


def test_a_cold_table_verifies_the_root_alone_then_every_row_teaches_it():
    s = settings()
    drafter = RecycleDrafter(s, [3, 4, 5])
    first = drafter.propose(step([6], top=[[7, 8], [9, 1], [2, 3]], prefill=True))  # the prompt's last 3 rows
    assert s.table.table[[3, 4, 5]].tolist() == [[7, 8], [9, 1], [2, 3]]
    assert first.tokens.tolist() == [[6]]  # nothing known about 6 yet: the root alone
    # the call verified [6]; its row says 6 -> (2, 9); 2 -> (4, 5) is unknown, 9 -> (1, 3) unknown, so depth 1 only
    proposal = drafter.propose(step([6], top=[[2, 9]]))
    assert proposal.tokens.tolist() == [[6, 2, 9]]
    assert proposal.paths.shape[1] == 2  # two leaves
    s.table.update(np.array([2, 9]), np.array([[4, 5], [1, 3]]))
    s.table.update(np.array([4]), np.array([[0, 11]]))
    full_tree, before, _ = drafter.draft(6, 1)
    # TREE in node order: (0), (1), (0,0), (0,1), (1,0), (0,0,0)
    assert full_tree.tokens.tolist() == [[6, 2, 9, 4, 5, 1, 0]]
    assert full_tree.size == len(TREE) + 1
    assert before.tolist() == [1, 6, 6, 2, 2, 9, 4]  # each node's parent's token, the root's: the one before it


def test_pairs_key_candidates_by_the_token_before_where_that_pair_was_seen():
    s = settings(context="pair")
    assert s.context == "pair" and settings().context == "token"
    drafter = RecycleDrafter(s, [3, 4])
    drafter.propose(step([6], top=[[7, 8], [9, 1]], prefill=True))  # rows of 3 (after none) and 4 (after 3)
    table = s.table
    assert table.candidates(np.array([3, 5, -1]), np.array([4, 4, 4]), np.array([0, 0, 1])).tolist() == [9, 9, 1]
    table.update(np.array([4]), np.array([[11, 12]]), np.array([5]))  # 4 after 5: its own candidates now
    assert table.table[4].tolist() == [11, 12]  # the token's are the latest
    assert table.candidates(np.array([3, 5, 2]), np.array([4, 4, 4]), np.array([0, 0, 0])).tolist() == [9, 11, 11]
    # the next call verified the root 6 (after 4): its pair (4, 6) is learnt from the call's first row
    drafter.propose(step([6], top=[[2, 3]]))
    assert table.candidates(np.array([4]), np.array([6]), np.array([1])).tolist() == [3]


def test_the_pair_hash_stays_in_its_slots():
    table = settings(context="pair", vocab=50_000).table
    rng = np.random.default_rng(0)
    tokens, before = rng.integers(0, 50_000, size=(2, 100_000))
    table.update(tokens, rng.integers(0, 50_000, size=(100_000, 2)), before)
    assert table.pair_keys.shape == (table.pair_slots,) and (table.pair_keys >= 0).mean() > 0.3


def test_every_verified_row_updates_the_table_accepted_or_not():
    s = settings()
    drafter = RecycleDrafter(s, [1])
    s.table.update(np.array([6, 2]), np.array([[2, 9], [4, 5]]))
    proposal = drafter.propose(step([6]))  # the tree verified next: 6, 2, 9, 4, 5 (9 has no candidates)
    verified = proposal.tokens[0].tolist()
    assert verified == [6, 2, 9, 4, 5]
    rows = [[10 + i, 20 + i] for i in range(len(verified))]
    drafter.propose(step([6, 2], top=rows))
    assert s.table.table[verified].tolist() == rows


def test_a_call_cut_to_its_first_nodes_updates_those_only():
    s = settings()
    drafter = RecycleDrafter(s, [1])
    s.table.update(np.array([6, 2]), np.array([[2, 9], [4, 5]]))
    assert drafter.propose(step([6])).size == 5
    drafter.propose(step([6], top=[[12, 13]]))  # the scheduler verified the root alone
    assert s.table.table[6].tolist() == [12, 13] and s.table.table[2].tolist() == [4, 5]


def test_the_schedulers_budget_keeps_the_best_nodes_only():
    order = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0]]  # best first, as engine.yaml records them
    s = settings(choices=order)
    drafter = RecycleDrafter(s, [1])
    s.table.update(np.array([6, 2, 9, 4]), np.array([[2, 9], [4, 5], [1, 3], [0, 11]]))
    assert RecycleDrafter.paid_drafts and drafter.draft_ms() > 0
    assert drafter.propose(step([6])).size == 7  # no budget: the whole tree
    drafter.limit = 4  # the root and the 3 best nodes: (0), (0, 0), (1)
    assert drafter.propose(step([6])).tokens.tolist() == [[6, 2, 9, 4]]
    drafter.limit = 1
    assert drafter.propose(step([6])).tokens.tolist() == [[6]]


def token_paths(proposal):
    """The proposal's nodes as token paths from the root (prefix-closed: every node's)."""
    tokens = proposal.tokens[0].tolist()
    return {tuple(tokens[n] for n in row[: k + 1] if n >= 0) for row in proposal.paths[0] for k in range(len(row))}


def test_a_match_in_the_context_is_grafted_onto_the_tree_first():
    s = settings(copy=4)
    assert s.copy == 4 and settings().copy == 0
    drafter = RecycleDrafter(s, [3, 4, 5, 6, 3, 4])
    s.table.update(np.array([5, 6, 2]), np.array([[6, 2], [3, 8], [4, 9]]))
    proposal = drafter.propose(step([5], prefill=True))
    # the context ends 3, 4, 5 (matched 3 tokens earlier): 6, 3, 4 copied; 5's candidates 6 (the copy's: one node)
    # and 2; 6's 3 (the copy's), 8; 2's 4
    assert token_paths(proposal) == {(5,), (5, 6), (5, 6, 3), (5, 6, 3, 4), (5, 2), (5, 6, 8), (5, 2, 4)}
    assert proposal.tokens[0, :2].tolist() == [5, 6] and proposal.size == 7
    assert token_paths(RecycleDrafter(settings(), [3, 4, 5, 6, 3, 4]).propose(step([5], prefill=True))) == {(5,)}
    rows = [[20 + i, 30 + i] for i in range(proposal.size)]  # each grafted row teaches its token
    drafter.propose(step([5, 6], top=rows))
    last = dict(zip(proposal.tokens[0].tolist(), rows))  # 4 is verified twice (copied, and after 2): its last row
    assert {t: s.table.table[t].tolist() for t in last} == last


def test_a_copy_is_drafted_whole_within_the_budget_and_the_step():
    s = settings(copy=4)
    s.table.update(np.array([5, 6, 2]), np.array([[6, 2], [3, 8], [4, 9]]))
    drafter = RecycleDrafter(s, [3, 4, 5, 6, 3, 4])
    drafter.limit = 2  # the budget: one table node; alone the copy goes whole all the same
    copied = {(5,), (5, 6), (5, 6, 3), (5, 6, 3, 4)}
    assert token_paths(drafter.propose(step([5], prefill=True))) == copied
    drafter.limit = 1  # no table node: the copy alone, a chain
    chain = drafter.propose(step([6, 3, 4, 5]))  # accepted the copy and 5: a 7-token match now, 4 copied
    assert chain.tokens.tolist() == [[5, 6, 3, 4, 5]] and token_paths(chain) == {*copied, (5, 6, 3, 4, 5)}
    rows = [[20, 21], [22, 23], [24, 25], [26, 27], [28, 29]]
    drafter.propose(step([5], top=rows))  # the chain's rows teach its tokens (5 twice: its last row)
    assert s.table.table[[6, 3, 4, 5]].tolist() == rows[1:]
    batched = RecycleDrafter(s, [3, 4, 5, 6, 3, 4])
    batched.limit, batched.batched = 3, True  # in a batch the copy is within the budget
    assert token_paths(batched.propose(step([5], prefill=True))) == {(5,), (5, 6), (5, 6, 3)}
    batched.limit = 1  # no table node pays: the copy alone, a chain the plan cuts to what pays
    assert batched.propose(step([6])).tokens.tolist() == [[6, 3, 4, 5, 6]]
    assert RecycleDrafter(s, [8]).propose(step([9], prefill=True)).size == 1  # no match, no candidates: the root
    long = RecycleDrafter(settings(copy=8), [*range(1, 10), *range(1, 9)])  # then 9: a 9-token match, 8 copied
    whole = long.propose(step([9], prefill=True))
    assert whole.size == len(TREE) + 1  # never past the engine's step: the copy's first 6
    assert token_paths(whole) == {(9, *range(1, k + 1)) for k in range(7)}


def test_a_graft_holds_every_path_of_both_within_its_nodes():
    rng = np.random.default_rng(0)
    for _ in range(300):
        paths = {tuple(rng.integers(0, 3, size=d).tolist()) for d in rng.integers(1, 4, size=8)}
        tree = Tree.from_choices(sorted({p[:k] for p in paths for k in range(1, len(p) + 1)}))
        proposal = Proposal.from_tree(rng.integers(0, 4, size=tree.size), tree)
        copy = rng.integers(0, 4, size=rng.integers(1, 6)).tolist()
        root = int(proposal.tokens[0, 0])
        merged, before = _graft(proposal, 7, copy, 64)
        want = token_paths(proposal) | {(root, *copy[:k]) for k in range(len(copy) + 1)}
        assert token_paths(merged) == want and merged.size == len(want)
        tokens = merged.tokens[0].tolist()
        parents = [7] + [
            tokens[int(np.flatnonzero(merged.mask[0, i] & (merged.offsets == merged.offsets[i] - 1))[0])]
            for i in range(1, merged.size)
        ]
        assert before.tolist() == parents
        cut, _ = _graft(proposal, 7, copy, 3)
        assert cut.size == min(3, len(want)) and token_paths(cut) <= want
        assert token_paths(cut) >= {(root, *copy[:k]) for k in range(min(len(copy), 2) + 1)}


def chances(drafter):
    """Each choice's chance of being accepted, as the drafter ranks them."""
    return dict(zip(*drafter.ranked()))


def changed(now, then):
    """The choices whose chance went up, and those that went down."""
    up = {c for c in now if now[c] > then[c] + 1e-12}
    return up, {c for c in now if now[c] < then[c] - 1e-12}


def test_each_node_learns_its_chance_of_acceptance_from_whole_trees_and_what_the_sequence_emits():
    order = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0]]  # best first
    s = settings(choices=order)
    drafter = RecycleDrafter(s, [1])
    prior = [RANK_PROFILE[0], RANK_PROFILE[0] ** 2, RANK_PROFILE[1], RANK_PROFILE[0] ** 3]
    assert drafter.ranked()[0][:4] == ((0,), (0, 0), (1,), (0, 0, 0))  # the rank profile's order
    assert drafter.expected_tokens(5) == pytest.approx(np.cumsum([1.0, *prior]))
    padded = drafter.expected_tokens(9)
    assert padded[6] == padded[7] == padded[8]  # beyond the whole tree: the whole tree's
    s.table.update(np.array([6, 2, 9, 4]), np.array([[2, 9], [4, 5], [1, 3], [0, 11]]))
    # the static tree from 6: (0) 2, (1) 9, (0, 0) 4, (0, 1) 5, (1, 0) 1, (0, 0, 0) 0
    assert drafter.propose(step([6])).size == 7
    before = chances(drafter)
    drafter.propose(step([2, 4, 6]))  # the step accepted (0) then (0, 0), then emitted 6, not (0, 0, 0)'s 0
    after = chances(drafter)
    assert changed(after, before) == ({(0,), (0, 0)}, {(1,), (0, 0, 0), (0, 1), (1, 0)})
    # cut to its root by the budget, a sequence still drafts its whole tree once in SHADOW_EVERY steps (its first
    # among them) and compares it with what it emits over the next steps: 2, 4, 0 match (0), (0, 0), (0, 0, 0)
    cut = RecycleDrafter(s, [1])
    cut.limit = 1
    assert [cut.propose(step([t])).size for t in (6, 2, 4)] == [1, 1, 1]
    assert chances(cut) == after  # nothing known yet: the chain goes on
    cut.propose(step([0]))
    learnt = chances(cut)
    assert changed(learnt, after) == ({(0,), (0, 0), (0, 0, 0)}, {(1,), (0, 1), (1, 0)})
    # nodes left out for want of candidates learn nothing (they cost no row): 9's candidates unknown, (1, 0) too
    partial = RecycleDrafter(s, [1])
    s.table.table[9] = -1
    assert partial.propose(step([6])).size == 6
    partial.propose(step([3]))  # a miss for the five nodes held
    assert changed(chances(partial), learnt) == (set(), {(0,), (1,), (0, 0), (0, 1), (0, 0, 0)})
    # in a batch the row of a node left out is padding: it is priced by its chance of being drafted and accepted
    alone, batched = chances(partial), dict(zip(*partial.ranked(padded=True)))
    assert batched[(1, 0)] < alone[(1, 0)] and all(batched[c] == alone[c] for c in alone if c != (1, 0))
    assert partial.expected_tokens(7, padded=True)[-1] < partial.expected_tokens(7)[-1]


def test_the_budget_cuts_the_tree_to_the_nodes_most_likely_accepted():
    order = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [1, 0]]  # best first by the rank profile
    s = settings(choices=order)
    s.table.update(np.array([6, 2, 9, 4]), np.array([[2, 9], [4, 5], [1, 3], [0, 11]]))
    drafter = RecycleDrafter(s, [1])
    drafter.propose(step([6]))
    for _ in range(200):  # the model goes down (1) then (1, 0) from 6, every step: 6 -> 9 -> 1 -> 6
        drafter.propose(step([9, 1, 6]))
    ranked, chance = drafter.ranked()
    assert ranked[:2] == ((1,), (1, 0)) and chance[0] > 0.9 and (np.diff(chance) <= 0).all()
    assert drafter.expected_tokens(3) == pytest.approx((1.0, 1 + chance[0], 1 + chance[0] + chance[1]))
    drafter.limit = 3
    assert drafter.propose(step([9, 1, 6])).tokens.tolist() == [[6, 9, 1]]  # the root, (1), (1, 0)


def test_each_tenant_learns_in_its_own_table():
    s = settings()
    a, b = RecycleDrafter.for_tenant(s, "a"), RecycleDrafter.for_tenant(s, "b")
    assert RecycleDrafter.for_tenant(s, "a").table is a.table and a.table is not b.table
    RecycleDrafter(a, [3]).propose(step([4], top=[[5, 6]], prefill=True))
    assert a.table.known == 1 and b.table.known == 0 and s.table.known == 0
    one = s.table.table.nbytes + s.table.pair_keys.nbytes + s.table.pair_top.nbytes
    assert RecycleDrafter.learnt_memory(s) == (3 * one, 3 * one)  # three tables (a, b, no tenant), made whole


def test_engine_yaml_settings_are_checked_when_the_engine_loads():
    with pytest.raises(SpecbuildError, match=r"field mode.drafter.top_k must be an integer >= 1, got 0"):
        settings(top_k=0)
    with pytest.raises(SpecbuildError, match=r"field mode.drafter.choices takes a rank >= top_k 2"):
        settings(choices=[[0], [2]])
    with pytest.raises(SpecbuildError, match=r"mode.drafter.choices\[1\] must have at least 1 item"):
        settings(choices=[[0], []])
    with pytest.raises(SpecbuildError, match=r"field mode.drafter.context must be one of token, pair, got 'x'"):
        settings(context="x")
    with pytest.raises(SpecbuildError, match=r"field mode.drafter.copy must be an integer >= 0, got -1"):
        settings(copy=-1)


@pytest.fixture(scope="module")
def toy_recycle(tmp_path_factory):
    root = tmp_path_factory.mktemp("recycle_toy")
    return toy_engines(root, speculative_mode="recycle", num_draft_tokens=8, recycle_top_k=3, recycle_depth=4)


@pytest.mark.parametrize("shape", fast_first(TINY_SHAPES, "another tiny shape: the fast tier checks the first"))
def test_greedy_equals_base_model_while_the_table_warms(toy_recycle, shape):
    model, eng, _ = toy_recycle[shape]
    engine = Engine(eng, threads=1)
    assert engine.manifest["lossless"] is True
    assert engine.drafter_settings.copy == 8  # copies grafted onto the tree: the default, up to the tree's nodes
    accepted = []
    for ids in PROMPTS * 2:
        result = engine.generate(input_ids=ids, max_new_tokens=30)
        assert result.output_ids == hf_greedy(model, ids, 30)
        accepted += result.accepted_per_step
    assert max(accepted) > 1  # the recycled candidates are accepted
    assert engine.drafter_settings.table.known > 0


def test_bad_settings_are_refused_before_any_work(toy_recycle, tmp_path):
    _, _, ckpt = toy_recycle["llama_gqa_llama3rope"]
    cases = [
        (dict(num_draft_tokens=0), "--num-draft-tokens 0 is invalid"),
        (dict(recycle_top_k=0), "--recycle-top-k 0 is invalid"),
        (dict(recycle_top_k=65), "--recycle-top-k 65 is invalid: expected at most"),
        (dict(recycle_depth=0), "--recycle-depth 0 is invalid"),
        (dict(recycle_context="trigram"), "--recycle-context must be one of token, pair, got 'trigram'"),
        (dict(num_draft_tokens=9, max_draft_len=8), "--num-draft-tokens 9 but --max-draft-len is 8"),
        (
            dict(num_draft_tokens=6, recycle_copy=7),
            "--recycle-copy 7 is invalid: expected at most --num-draft-tokens 6",
        ),
        (dict(recycle_copy=-1), "--recycle-copy -1 is invalid"),
        (dict(num_draft_tokens=600), "at most 511 per step"),
        (dict(suffix_depth=4), "--suffix-depth does not apply to --speculative-mode recycle"),
    ]
    for options, message in cases:
        with pytest.raises(SpecbuildError, match=message):
            build = BuildOptions(backends=ORT_ONLY, speculative_mode="recycle", **options)
            build_engine(ckpt, tmp_path / "e", build, log=quiet)
        assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    fast_first([(1.0, 0, 1.0), (1.5, 4, 0.9)], "another sampling setting: the fast tier checks the first"),
)
def test_sampling_preserves_the_base_distribution(tmp_path, temperature, top_k, top_p):
    options = dict(speculative_mode="recycle", num_draft_tokens=4, recycle_top_k=2, recycle_depth=3)
    check_mode_sampling(tmp_path, temperature, top_k, top_p, **options)
