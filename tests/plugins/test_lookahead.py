"""Lookahead mode: each call's rows against their definition (mask, positions, paths) for several (W, N, G), the
window's Jacobi update and the pool, the context's continuation (lookup) and the window it leaves out, exact greedy
ids on tiny models of every shape at fp32 and int4, the base distribution when sampling, and bad settings refused
before any work."""

import itertools

import numpy as np
import pytest

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.errors import SpecbuildError
from specbuild.plugins.lookahead import DEFAULT_LOOKUP, step_rows
from specbuild.plugins.lookahead.drafter import LookaheadDrafter, NgramPool
from specbuild.runtime.drafter import StepResult
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.plugins.host_mode_helpers import check_mode_sampling, toy_engines
from tests.plugins.medusa_helpers import toy_model
from tests.shapes import TINY_SHAPES
from tests.tiers import fast_first, full

pytestmark = pytest.mark.xdist_group("lookahead")

PROMPTS = [[1, 5, 9, 3, 7, 5, 9, 3], [1, 4], [1, 11, 10, 6, 2, 8, 3, 11, 10]]
SETTINGS = [(1, 1, 0), (2, 2, 1), (3, 2, 2), (4, 3, 4), (2, 4, 3), (5, 3, 0), (1, 3, 2)]


def drafter(w, n, g, prompt=(), pool="window", lookup=None):
    fields = {"window": w, "ngram": n, "guesses": g, "pool": pool}
    if lookup is not None:  # engines written before the key existed have none: no lookup
        fields["lookup"] = lookup
    return LookaheadDrafter(LookaheadDrafter.read_settings({"mode": {"drafter": fields}}), list(prompt))


def step(tokens, top=None):
    """A StepResult that accepted `tokens`; top: the argmax of each row of the call (ef.ROW_TOP_TOKENS)."""
    outputs = {} if top is None else {ef.ROW_TOP_TOKENS: np.asarray([top], dtype=np.int64)}
    return StepResult(list(tokens), np.zeros(len(tokens), dtype=np.int64), outputs)


def reference_rows(root, guesses, levels, w):
    """The rows of a call from the definition (LADE's j_make_causal_mask_multilevel, llama.cpp's
    examples/lookahead), each a
    label: ("root",), ("guess", n-gram index, token index), ("cell", level, column); in the drafter's order (the
    root, the guesses' trie, then level 0's columns 1..W-1 and each further level's W columns)."""
    first = {}  # each distinct prefix of a guess (n-grams sharing a prefix share its nodes): where it first occurs
    for j, guess in enumerate(guesses):
        for k in range(len(guess)):
            first.setdefault(tuple(guess[: k + 1]), (len(first), j, k))
    # the tree's normal form: shallower nodes first, siblings in order of appearance
    rows = [("root",)] + [("guess", j, k) for _, j, k in sorted(first.values(), key=lambda x: (x[2], x[0]))]
    rows += [("cell", 0, i) for i in range(1, w)]
    rows += [("cell", lv, i) for lv in range(1, len(levels)) for i in range(w)]
    return rows


def reference_sees(a, b, guesses):
    """Whether row label a attends to row label b, from the definition alone."""
    if b == ("root",):
        return True
    if a[0] == "guess" and b[0] == "guess":  # causal within its own n-gram (shared prefixes are the same nodes)
        return b[2] <= a[2] and tuple(guesses[b[1]][: b[2] + 1]) == tuple(guesses[a[1]][: b[2] + 1])
    if a[0] == "cell" and b[0] == "cell":
        (_, la, ia), (_, lb, ib) = a, b
        if lb == 0:
            return ib <= ia  # row 0 up to its column
        return ib == ia and lb <= la  # its own column's levels 1..la
    return False  # the two branches never see each other


@pytest.mark.parametrize("w,n,g", SETTINGS)
def test_each_calls_rows_match_the_definition(w, n, g):
    prompt = [7, 3, 9, 3, 9, 4, 3, 9, 5, 8]
    d = drafter(w, n, g, prompt, pool="context")
    rng = np.random.default_rng(w * 100 + n * 10 + g)
    proposal = d.propose(step([3]))
    for _ in range(4):  # warm-up levels, then full windows
        root = int(proposal.tokens[0, 0])
        if n == 1:
            assert proposal.size == 1
            break
        guesses = d.pool.get(root)[:g]
        rows = reference_rows(root, guesses, d.levels, w)
        assert proposal.size == len(rows) <= step_rows(w, n, g)
        mask, offsets, tokens = proposal.mask[0], proposal.offsets, proposal.tokens[0]
        for i, j in itertools.product(range(len(rows)), repeat=2):
            want = i == j or reference_sees(rows[i], rows[j], guesses)
            assert mask[i, j] == want, (rows[i], rows[j])
        for i, label in enumerate(rows):
            if label[0] == "guess":
                assert offsets[i] == label[2] + 1 and tokens[i] == guesses[label[1]][label[2]]
            elif label[0] == "cell":
                _, level, column = label
                assert offsets[i] == column + level  # position p + i + l
                assert tokens[i] == d.levels[level][column - 1 if level == 0 else column]
        # the paths: the root alone or one path per guess, spelling it; window rows lie on none
        paths = [[x for x in p if x >= 0] for p in proposal.paths[0].tolist()]
        assert sorted(tuple(tokens[p[1:]].tolist()) for p in paths) == sorted(
            {tuple(x) for x in guesses} - {tuple(x[:k]) for x in guesses for k in range(len(x))}
        ) or (not guesses and paths == [[0]])
        assert all(rows[x][0] != "cell" for p in paths for x in p)
        top = rng.integers(0, 12, size=proposal.size).tolist()
        accepted = [int(rng.integers(0, 12))]
        proposal = d.propose(step(accepted, top))


def test_plain_and_smallest_settings():
    d = drafter(1, 1, 0, [4, 5, 6])
    assert d.propose(step([6])).size == 1  # (1, 1, 0): plain decoding
    d = drafter(2, 2, 1, [4, 5, 4, 5], pool="prompt")  # (2, 2, 1): one window cell, one 1-token guess
    p = d.propose(step([4]))
    assert p.size == 3 == step_rows(2, 2, 1)
    assert p.tokens[0, :2].tolist() == [4, 5]  # the root, the pool's guess (5 followed 4 in the prompt)
    assert p.mask[0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    assert p.offsets.tolist() == [0, 1, 1]
    assert p.paths[0].tolist() == [[0, 1]]


def test_the_window_warms_up_then_feeds_the_pool_and_shifts():
    d = drafter(3, 4, 2, [1, 2, 3])  # W 3, N 4: three levels; the window alone feeds the pool
    assert len(d.levels[0]) == 2 and set(d.levels[0]) <= {1, 2, 3}  # level 0 starts as tokens of the prompt
    level0 = d.levels[0] = [4, 5]  # distinct keys for the pool below
    p = d.propose(step([9]))  # row 0 only: the root and level 0
    assert p.size == 3
    d.propose(step([9], top=[20, 21, 22]))  # the argmaxes of row 0 become level 1
    assert d.levels == [level0, [20, 21, 22]]
    p = d.propose(step([8], top=[0] * 3 + [30, 31, 32]))  # then of level 1: level 2 (the last of N - 1)
    assert d.levels == [level0, [20, 21, 22], [30, 31, 32]] and d.pool.get(8) == []
    assert p.size == 1 + 2 + 3 + 3
    d.propose(step([7, 6], top=[0] * 6 + [40, 41, 42]))  # complete: each column's n-gram goes to the pool
    assert d.pool.get(8) == [(20, 30, 40)]  # column 0's key is the last call's root
    assert d.pool.get(4) == [(21, 31, 41)] and d.pool.get(5) == [(22, 32, 42)]  # columns 1, 2: level 0's keys
    assert d.levels == [[21, 22], [30, 31, 32], [40, 41, 42]]  # shifted by one position


def test_the_cost_model_counts_the_window_rows_but_not_as_drafts():
    from specbuild.runtime.speculation import Shape

    d = drafter(3, 3, 2, [5, 6, 7, 5, 6, 8], pool="prompt")
    p = d.propose(step([5]))
    p = d.propose(step([5], top=[1] * p.size))  # two 2-token guesses sharing their 6, then the window's 2 + 3 cells
    assert p.size == 1 + 3 + 5 and p.offsets.max() == 3  # the window reaches further than any guess
    assert Shape.of(p) == Shape(9, 2, False)  # verifying it may accept 2 drafts at most


def test_step_rows_hold_the_window_or_the_lookup_never_both():
    assert step_rows(4, 3, 4) == 1 + 3 + 4 + 8 == step_rows(4, 3, 4, 7)  # the window's 7 cells or 7 copied tokens
    assert step_rows(1, 3, 2, 10) == 1 + 10 + 4
    assert step_rows(1, 1, 0, 5) == 6 and step_rows(1, 1, 0) == 1


def test_a_call_with_the_contexts_continuation_verifies_it_with_the_pool_and_leaves_the_window_out():
    prompt = [4, 5, 6, 4, 5, 7, 1, 4, 5]
    d = drafter(2, 3, 2, prompt, pool="prompt", lookup=3)
    levels = [list(x) for x in d.levels]
    # the context ends 4, 5, 7: (4, 5, 7) occurred at 3, followed by 1, 4, 5 (a 3-token match: 3 copied tokens);
    # the pool's guess for 7, (1, 4) from the prompt's (7, 1, 4), shares their prefix
    p = d.propose(step([7]))
    assert p.tokens.tolist() == [[7, 1, 4, 5]] and p.offsets.tolist() == [0, 1, 2, 3]
    assert p.paths[0].tolist() == [[0, 1, 2, 3]] and p.mask[0].tolist() == np.tril(np.ones((4, 4), bool)).tolist()
    assert p.size <= step_rows(2, 3, 2, 3)
    # accepted 1, 4 and the bonus 9: (4, 9) never occurred, so no copy: the window is back, as it was
    p = d.propose(step([1, 4, 9], top=[0, 0, 0, 0]))
    assert d.levels == levels
    assert p.size == 2 and p.tokens[0, 1] == levels[0][0] and p.paths[0].tolist() == [[0]]
    short = drafter(2, 3, 0, prompt, pool="window", lookup=2)  # at most L copied tokens
    assert short.propose(step([7])).tokens.tolist() == [[7, 1, 4]]
    one = drafter(2, 3, 0, [4, 9, 1, 5], pool="window", lookup=8)  # as many as matched: a 1-token match, one token
    assert one.propose(step([9])).tokens.tolist() == [[9, 1]]
    assert drafter(2, 1, 0, prompt, lookup=3).propose(step([7])).tokens.tolist() == [[7, 1, 4, 5]]  # N 1: copy only


def test_a_call_cut_to_its_root_leaves_the_window_as_it_was():
    d = drafter(2, 3, 1, [1, 2])
    d.propose(step([5]))
    before = [list(x) for x in d.levels]
    d.propose(step([6], top=[9]))  # the scheduler verified the root alone: one row of outputs
    assert d.levels == before


def test_the_pool_keeps_the_most_recent_distinct_ngrams_per_key():
    pool = NgramPool(2)
    for value in [(1, 2), (3, 4), (1, 2), (5, 6), (5, 6)]:
        pool.add(7, value)
    assert pool.get(7) == [(5, 6), (1, 2)]
    assert NgramPool(0).get(7) == [] and pool.get(8) == []
    d = drafter(2, 3, 4, [1, 2, 3, 1, 2, 4, 1, 2, 3], pool="prompt")
    assert d.pool.get(1) == [(2, 3), (2, 4)]  # the prompt's n-grams, the later occurrence first
    assert d.propose(step([1])).tokens[0, :4].tolist() == [1, 2, 3, 4]  # (2, 3) and (2, 4) share their 2
    d.propose(step([7]))
    assert (3, 7) not in d.pool.get(2)  # "prompt": the output's n-grams do not go to the pool
    d = drafter(2, 3, 4, [1, 2, 3, 1, 2, 4, 1, 2], pool="context")  # the context's: the prompt's and the output's
    d.propose(step([3, 9]))
    assert d.pool.get(2) == [(3, 9), (4, 1), (3, 1)] and d.pool.get(1) == [(2, 3), (2, 4)]  # (1, 2, 3): most recent
    assert drafter(2, 3, 4, [1, 2, 3, 1, 2, 4], pool="window").pool.get(1) == []


def test_host_work_does_not_grow_with_the_context():
    d = drafter(4, 3, 4, list(range(2000)) * 2, pool="context", lookup=16)
    p = d.propose(step([5]))
    for i in range(50):
        p = d.propose(step([i % 7], top=list(range(p.size))))
        assert p.size <= step_rows(4, 3, 4, 16)
    assert sum(len(v) for v in d.pool._entries.values()) <= 4000 + 50 * 4
    assert sum(len(v) for v in d.index._starts.values()) == 3 * (4000 + 51) - 3  # n-grams of 1..3 per token


@pytest.fixture(scope="module")
def toy_lookahead(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookahead_toy")
    options = dict(lookahead_window=3, lookahead_ngram=3, lookahead_guesses=3)
    return toy_engines(root, speculative_mode="lookahead", **options)


@pytest.mark.parametrize("shape", fast_first(TINY_SHAPES, "another tiny shape: the fast tier checks the first"))
def test_greedy_equals_base_model(toy_lookahead, shape):
    model, eng, _ = toy_lookahead[shape]
    engine = Engine(eng, threads=1)
    assert engine.manifest["lossless"] is True
    assert engine.manifest["mode"]["drafter"] == {
        "window": 3,
        "ngram": 3,
        "guesses": 3,
        "lookup": DEFAULT_LOOKUP,
        "pool": "context",
    }
    for options, most in (({}, DEFAULT_LOOKUP + 1), ({"lookup": 0}, 3)):  # with and without the context's copy
        accepted = []
        for ids in PROMPTS:
            chunks = []
            result = engine.generate(input_ids=ids, max_new_tokens=40, stream=chunks.append, draft_options=options)
            assert result.output_ids == hf_greedy(model, ids, 40)
            assert sum(chunks, []) == result.output_ids
            accepted += result.accepted_per_step
        assert np.mean(accepted) > 1.2, options  # guesses really get accepted
        assert max(accepted) <= most  # at most N - 1 guessed (or L copied) tokens + the bonus


@full("int4: two quantized engines (the fast tier builds int4 in tests/runtime/test_exactness.py)")
def test_int4_equals_the_int4_none_engine(tmp_path):
    from specbuild.builder.checkpoint.convert import convert_checkpoint

    toy_model("llama_gqa_llama3rope", tmp_path / "hf", seed=5)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    common = dict(backends=ORT_ONLY, weights="int4")
    none = Engine(build_engine(ckpt, tmp_path / "none", BuildOptions(**common), log=quiet), threads=1)
    options = BuildOptions(speculative_mode="lookahead", **common)
    lookahead = Engine(build_engine(ckpt, tmp_path / "lookahead", options, log=quiet), threads=1)
    accepted = []
    for ids in PROMPTS:
        result = lookahead.generate(input_ids=ids, max_new_tokens=40)
        assert result.output_ids == none.generate(input_ids=ids, max_new_tokens=40).output_ids
        accepted += result.accepted_per_step
    assert max(accepted) > 1


def test_bad_settings_are_refused_before_any_work(toy_lookahead, tmp_path):
    _, _, ckpt = toy_lookahead["llama_gqa_llama3rope"]
    cases = [
        (dict(lookahead_window=0), "--lookahead-window 0 is invalid"),
        (dict(lookahead_ngram=0), "--lookahead-ngram 0 is invalid"),
        (dict(lookahead_guesses=-1), "--lookahead-guesses -1 is invalid"),
        (dict(lookahead_ngram=17), "--lookahead-ngram 17 is invalid: expected at most 16"),
        (dict(lookahead_window=40, lookahead_ngram=14, lookahead_guesses=2), "verify 546 tokens per step: at most 512"),
        (dict(lookahead_pool="all"), "--lookahead-pool must be one of window, prompt, context, got 'all'"),
        (dict(lookahead_lookup=-1), "--lookahead-lookup -1 is invalid"),
        (dict(lookahead_lookup=65), "--lookahead-lookup 65 is invalid: expected at most 64"),
        (dict(num_draft_tokens=3), "--num-draft-tokens does not apply to --speculative-mode lookahead"),
    ]
    for settings, message in cases:
        with pytest.raises(SpecbuildError, match=message):
            options = BuildOptions(backends=ORT_ONLY, speculative_mode="lookahead", **settings)
            build_engine(ckpt, tmp_path / "e", options, log=quiet)
        assert not (tmp_path / "e").exists()


def test_engine_yaml_settings_are_checked_when_the_engine_loads():
    with pytest.raises(SpecbuildError, match="field mode.drafter.guesses must be an integer >= 0, got -2"):
        drafter(2, 3, -2)
    with pytest.raises(SpecbuildError, match="field mode.drafter.pool must be one of window, prompt, context, got 'y'"):
        drafter(2, 3, 1, pool="y")
    with pytest.raises(SpecbuildError, match="field mode.drafter.lookup must be an integer >= 0, got 'x'"):
        drafter(2, 3, 1, lookup="x")


@full("sampling with point-mass drafts: the fast tier checks n-gram's (one acceptance rule in every graph)")
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.5, 4, 0.9)])
def test_sampling_preserves_the_base_distribution(tmp_path, temperature, top_k, top_p):
    options = dict(speculative_mode="lookahead", lookahead_window=2, lookahead_ngram=3, lookahead_guesses=2)
    check_mode_sampling(tmp_path, temperature, top_k, top_p, **options)


def test_a_request_may_ask_for_a_smaller_setting_than_the_built_one(toy_lookahead):
    model, eng, _ = toy_lookahead["llama_gqa_llama3rope"]
    engine = Engine(eng, threads=1)
    ids = PROMPTS[2]
    want = hf_greedy(model, ids, 30)
    smaller = (
        {"window": 2, "ngram": 2, "guesses": 1, "lookup": 2},
        {"window": 1, "ngram": 1, "guesses": 0, "lookup": 0},
    )
    for options in (*smaller, {"ngram": 3}):
        result = engine.generate(input_ids=ids, max_new_tokens=30, draft_options=options)
        assert result.output_ids == want, options
        if options["ngram"] == 1:
            assert set(result.accepted_per_step) == {1}  # (1, 1, 0, 0): plain decoding
    window_only = {"pool": "window", "guesses": 0, "lookup": 0}
    plain = engine.generate(input_ids=ids, max_new_tokens=30, draft_options=window_only)
    assert plain.output_ids == want and set(plain.accepted_per_step) == {1}  # nothing to verify without guesses
    cases = [
        ({"window": 4}, "drafting option window must be an integer from 1 to 3 \\(the engine's\\), got 4"),
        ({"guesses": -1}, "drafting option guesses must be an integer from 0 to 3"),
        ({"ngram": True}, "drafting option ngram must be an integer from 1 to 3"),
        ({"lookup": DEFAULT_LOOKUP + 1}, f"drafting option lookup must be an integer from 0 to {DEFAULT_LOOKUP}"),
        ({"pool": "no"}, "drafting option pool must be one of window, prompt, context, got 'no'"),
        ({"depth": 2}, "drafting option 'depth' is not one of window, ngram, guesses, lookup, pool"),
    ]
    for options, message in cases:
        with pytest.raises(SpecbuildError, match=message):
            engine.generate(input_ids=ids, max_new_tokens=4, draft_options=options)


def test_modes_without_drafting_options_refuse_them(tmp_path):
    from specbuild.runtime.drafter import GraphDrafter

    with pytest.raises(SpecbuildError, match="drafting option 'window': this engine's mode takes none"):
        GraphDrafter.narrowed(None, {"window": 2})
    assert GraphDrafter.narrowed("kept", {}) == "kept"


def test_run_takes_drafting_options(toy_lookahead):
    import json

    from click.testing import CliRunner

    from specbuild.cli.main import cli

    model, eng, _ = toy_lookahead["llama_gqa_llama3rope"]

    def run(*extra):
        args = ["run", "--engine-dir", str(eng), "--input-ids", "1,11,10,6,2", "--max-new-tokens", "12", "--json"]
        return CliRunner().invoke(cli, [*args, *extra], catch_exceptions=False)

    res = run("--draft-option", "window=2", "--draft-option", "pool=prompt")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["output_ids"] == hf_greedy(model, [1, 11, 10, 6, 2], 12)
    for bad, needle in (("window=9", "drafting option window must be an integer from 1 to 3"), ("oops", "KEY=VALUE")):
        res = run("--draft-option", bad)
        assert res.exit_code == 1 and res.stdout == ""
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
