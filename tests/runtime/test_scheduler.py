"""In-flight batching: every request's output is its batch-1 output whatever joins, leaves, drafts or is cancelled
around it, for every mode at fp32 and int4; the scheduler's queue, chunked prefill, stop strings, streams, and the
speculation policy's choice by measured cost."""

import asyncio

import numpy as np
import pytest

from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine, SamplingParams
from specbuild.runtime.scheduler import Request, Scheduler
from specbuild.runtime.speculation import (
    EXPLORE_EVERY,
    PRIOR_ACCEPTANCE,
    REFRESH_PLAIN,
    CostCurve,
    LoneCalls,
    Shape,
    Speculation,
)
from tests.runtime.conftest import MODES, PROMPTS
from tests.tiers import fast_first, full

pytestmark = pytest.mark.xdist_group("batching")

WEIGHTS = ("fp32", "int4")


def _sampling(i: int, temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=i, top_k=0 if i % 2 else 5)


def _alone(engine, temperature: float) -> list[list[int]]:
    out = []
    for i, ids in enumerate(PROMPTS):
        scheduler = Scheduler(engine, max_batch_size=1)
        handle = scheduler.submit(Request(ids, max_new_tokens=8 + 3 * i, sampling=_sampling(i, temperature)))
        handle.wait()
        out.append(handle.output_ids)
    return out


def _batched(engine, temperature: float, **scheduler_kwargs):
    """All 16 requests through one scheduler, joining a few steps apart and leaving at their own lengths."""
    scheduler = Scheduler(engine, **scheduler_kwargs)
    handles = []
    for i, ids in enumerate(PROMPTS):
        handles.append(scheduler.submit(Request(ids, max_new_tokens=8 + 3 * i, sampling=_sampling(i, temperature))))
        for _ in range(i % 3):
            scheduler.step()
    scheduler.run_until_idle()
    return scheduler, handles


FAST_BATCHED = (("ngram", "fp32"), ("eagle3", "fp32"))  # a host-drafted and an engine-drafted mode with state
OTHER_BATCHED = "another mode or precision: the fast tier checks n-gram and EAGLE-3 at fp32"


@pytest.mark.parametrize(
    "mode,weights",
    [
        case if case in FAST_BATCHED else pytest.param(*case, marks=full(OTHER_BATCHED))
        for case in [(mode, weights) for mode in MODES for weights in WEIGHTS]
    ],
)
def test_batched_output_equals_batch_one_output(mode_engines, mode, weights):
    """Greedy and seeded sampling: each request gives its batch-1 tokens in a batch of 16 that join and leave at
    different steps, prefilled in chunks, with drafting on (every step) and chosen by cost (auto)."""
    engine = Engine(mode_engines[mode, weights], threads=1)
    for temperature in (0.0, 0.9):
        want = _alone(engine, temperature)
        for policy in ("always", "auto"):
            scheduler, handles = _batched(engine, temperature, prefill_chunk=5, speculation=policy)
            got = [h.output_ids for h in handles]
            assert got == want, (mode, weights, temperature, policy)
            assert all(h.stop_reason in ("eos", "max_new_tokens") for h in handles)
            assert scheduler.steps < sum(len(w) for w in want)  # requests did share calls
            if mode != "none" and policy == "always" and temperature == 0.0:
                assert max(n for h in handles for n in h.accepted_per_step) > 1  # drafts were accepted


def test_chains_cut_short_give_the_batch_one_output(mode_engines, monkeypatch):
    """Steps that verify only the first tokens of the n-gram chains (the cost model's cut) change no token."""
    monkeypatch.setattr(Speculation, "plan", lambda self, shapes: min(2, max(s.size for s in shapes)))
    engine = Engine(mode_engines["ngram", "fp32"], threads=1)
    for temperature in (0.0, 0.9):
        want = _alone(engine, temperature)
        scheduler, handles = _batched(engine, temperature, speculation="auto")
        assert [h.output_ids for h in handles] == want, temperature
        assert scheduler.speculation.drafted_steps > 0 and scheduler.speculation.padded_rows > 0


@pytest.mark.parametrize(
    "mode",
    fast_first(["eagle3", "medusa", "eagle", "redrafter"], "another engine-drafted mode: the fast tier checks EAGLE-3"),
)
def test_calls_that_draft_nothing_give_the_batch_one_output(mode_engines, mode, monkeypatch):
    """Engine-drafted modes: calls whose graph drafts no next tree (ef.DRAFT_ROWS empty: plain decoding under load)
    between calls that draft change no token, greedy or sampled, and so do prompts prefilled without drafting (while
    the running rows decode plainly) beside prompts prefilled with it."""
    draws = np.random.default_rng(1)  # a third of the calls plain, at no fixed period (prefills meet both kinds)
    monkeypatch.setattr(Speculation, "drafts", lambda self, shapes: bool(draws.random() >= 1 / 3))
    prefills = []  # whether each prompt chunk was prefilled with the drafting
    chunk = Scheduler._prefill_chunk

    def spy(self, handle, budget):
        prefills.append(self._drafting)
        return chunk(self, handle, budget)

    engine = Engine(mode_engines[mode, "fp32"], threads=1)
    assert engine.layout.selects_rows
    for temperature in (0.0, 0.9):
        want = _alone(engine, temperature)
        monkeypatch.setattr(Scheduler, "_prefill_chunk", spy)
        scheduler, handles = _batched(engine, temperature, speculation="always")  # calls that draft verify all
        monkeypatch.setattr(Scheduler, "_prefill_chunk", chunk)
        assert [h.output_ids for h in handles] == want, temperature
        assert 0 < scheduler.speculation.plain_steps < scheduler.steps
        assert True in prefills and False in prefills
        if temperature == 0.0:
            assert max(n for h in handles for n in h.accepted_per_step) > 1  # drafts were accepted


@pytest.mark.parametrize(
    "mode", fast_first(["eagle3", "eagle"], "EAGLE-1/2's draft net: the fast tier checks EAGLE-3's")
)
def test_plain_calls_leave_no_draft_cache_and_drafting_reads_what_there_is(mode_engines, mode, monkeypatch):
    """A call that drafts for no row skips the draft network (one If in the graph): the positions it commits hold no
    draft KV and are flagged so in the draft_valid state; drafting calls commit theirs, held; drafting later over
    such gaps changes no token."""
    engine = Engine(mode_engines[mode, "fp32"], threads=1)
    ids, n = PROMPTS[3], 40
    want = engine.generate(input_ids=ids, max_new_tokens=n).output_ids
    pattern = iter([False, False, False, True, True, False, True] + [True] * 200)  # decode calls that draft
    monkeypatch.setattr(Speculation, "drafts", lambda self, shapes: next(pattern))
    scheduler = Scheduler(engine, max_batch_size=1, speculation="always")
    handle = scheduler.submit(Request(ids, max_new_tokens=n))
    while len(handle.accepted_per_step) < 7:
        scheduler.step()
    valid = scheduler.batch.states.arrays["draft_valid"]
    kv = scheduler.batch.states.arrays["draft_kv"]  # [Ld,2,B,Hkv,C,D]
    drafted = [False, False, False, True, True, False, True]
    expected = [True] * len(ids) + [d for d, k in zip(drafted, handle.accepted_per_step) for _ in range(k)]
    assert valid.lengths[0] == len(expected)
    assert valid.data[0, : len(expected)].tolist() == expected
    missing = ~np.array(expected)
    assert not kv.data[:, :, 0, :, : len(expected)][:, :, :, missing].any()  # nothing was written there
    assert kv.data[:, :, 0, :, : len(expected)][:, :, :, ~missing].any()
    scheduler.run_until_idle()
    assert handle.output_ids == want


def test_requests_beyond_the_slots_wait_and_cancelled_ones_free_their_slot(mode_engines):
    engine = Engine(mode_engines["ngram", "fp32"], threads=1)
    want = _alone(engine, 0.0)
    scheduler = Scheduler(engine, max_batch_size=3)
    handles = [scheduler.submit(Request(ids, max_new_tokens=8 + 3 * i)) for i, ids in enumerate(PROMPTS)]
    most = 0
    for step in range(10_000):
        if not scheduler.step():
            break
        most = max(most, scheduler.active)
        if step == 3:
            handles[1].cancel()
    assert most <= 3
    assert handles[1].stop_reason == "cancelled" and handles[1].finished
    assert [h.output_ids for i, h in enumerate(handles) if i != 1] == [w for i, w in enumerate(want) if i != 1]


def test_prompts_beyond_the_context_are_refused_at_submit(mode_engines):
    engine = Engine(mode_engines["ngram", "fp32"], threads=1)
    with pytest.raises(SpecbuildError, match="max_seq_len is 96"):
        engine.scheduler.submit(Request([1] * 96))
    with pytest.raises(SpecbuildError, match="max-batch-size 17"):
        Scheduler(engine, max_batch_size=17)
    # a request that reaches the context limit ends there
    result = engine.generate(input_ids=[1] * 90, max_new_tokens=50)
    assert result.stop_reason == "max_seq_len" and len(result.output_ids) == 96 - 90 + 1


def test_stop_strings_end_the_output_even_inside_a_step(mode_engines, monkeypatch):
    """A stop string completed by the second of three or more tokens accepted in one step ends the output there."""
    engine = Engine(mode_engines["eagle3", "fp32"], threads=1)

    class Letters:
        def decode(self, ids):
            return "".join(chr(ord("a") + i) for i in ids)

    monkeypatch.setattr(engine, "_codec", Letters())
    monkeypatch.setitem(engine.manifest["files"], "tokenizer", "letters")  # results decode their text

    def run(ids, stop=()):
        handle = Scheduler(engine, speculation="always").submit(Request(ids, max_new_tokens=40, stop=stop))
        handle.wait()
        return handle

    for ids in PROMPTS:
        whole = run(ids)
        steps = whole.accepted_per_step
        multi = [i for i, n in enumerate(steps) if n >= 3]
        if multi:
            break
    else:
        pytest.fail("no step accepted three tokens")
    end = 1 + sum(steps[: multi[0]]) + 2  # output tokens up to the second token of that step
    stop = Letters().decode(whole.output_ids[end - 2 : end])
    first = Letters().decode(whole.output_ids).find(stop)  # it may occur earlier
    result = engine.result(run(ids, stop=(stop, "zzzz")))
    assert result.stop_reason == "stop"
    assert result.output_ids == whole.output_ids[: first + 2]
    assert result.text == Letters().decode(whole.output_ids)[:first]


def test_streams_give_each_request_only_its_new_tokens(mode_engines):
    engine = Engine(mode_engines["eagle3", "fp32"], threads=1)
    scheduler = Scheduler(engine)
    seen: dict[int, list[int]] = {0: [], 1: []}
    a = scheduler.submit(Request(PROMPTS[0], max_new_tokens=20, on_tokens=seen[0].extend))
    b = scheduler.submit(Request(PROMPTS[1], max_new_tokens=25))
    chunks = list(b)  # iterating drives the scheduler
    assert all(chunks) and sum(chunks, []) == b.output_ids and len(b.output_ids) == 25
    a.wait()
    assert seen[0] == a.output_ids and len(a.output_ids) == 20


def test_async_stream_with_a_background_scheduler(mode_engines):
    engine = Engine(mode_engines["ngram", "fp32"], threads=1)
    scheduler = Scheduler(engine).start()

    async def collect(ids, n):
        handle = scheduler.submit(Request(ids, max_new_tokens=n))
        got = [t async for chunk in handle.stream() for t in chunk]
        return got, handle.output_ids

    async def main():
        return await asyncio.gather(collect(PROMPTS[2], 12), collect(PROMPTS[5], 17))

    results = asyncio.run(main())
    scheduler.stop(timeout=30)
    assert all(got == out and got for got, out in results)
    with pytest.raises(SpecbuildError, match="stopping"):
        scheduler.submit(Request(PROMPTS[0]))


def _curve(ms: dict, step_tokens: int = 8, slots: int = 16, plain: dict | None = None) -> CostCurve:
    """A cost curve whose measurements are `ms[(b, t)]` (seconds = ms / 1000) and, for a graph that can skip its
    drafting, `plain[b]` for a b x 1 call that drafts nothing, counting the calls made."""
    calls = []

    def run_call(b, t, draft):
        calls.append((b, t) if draft else (b, "plain"))
        return (ms[b, t] if draft else plain[b]) / 1000

    curve = CostCurve(run_call, "test", "cpu", step_tokens, slots, plain_calls=plain is not None)
    curve.calls = calls
    return curve


def _proposal(tokens: list[int], parents: list[int] | None = None):
    """A chain of `tokens` (root first), or the tree with these parents (parents[i] of node i + 1)."""
    from specbuild.runtime.drafter import Proposal
    from specbuild.tree import Tree

    if parents is None:
        parents = list(range(len(tokens) - 1))
    choices, paths = [], {0: ()}
    for node, parent in enumerate(parents, 1):
        siblings = sum(1 for p in parents[: node - 1] if p == parent)
        paths[node] = (*paths[parent], siblings)
        choices.append(list(paths[node]))
    return Proposal.from_tree(tokens, Tree.from_choices(choices))


CHAIN = {"chain": True}


def test_speculation_follows_the_measured_cost(monkeypatch):
    """Drafting pays where extra rows are cheap (small batches) and not where each row costs its full price; a lone
    sequence verifies its whole proposal; `off` and `always` ignore the cost."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    ms = {(b, t): 10.0 + b + (0.2 if b <= 2 else 0.3) * b * (t - 1) for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8)}
    policy = Speculation("auto", lambda: _curve(ms))
    tree = Shape(8, 3, False)
    assert policy.plan([tree]) == 8  # alone: no cost measured
    assert policy.plan([tree] * 2) == 8  # 2 rows: 8 tokens for +23 % of the cost, 1 + 0.5 + 0.25 + 0.125 expected
    assert policy.plan([tree] * 16) == 1  # 16 rows: each token row costs its full price
    for _ in range(400):  # every draft accepted, many times over
        policy.observe("seq", _proposal([1, 2, 3, 4]), [2, 3, 4, 5])
    assert policy.expected(3) > 3.9 and policy.plan([tree] * 16) == 8
    assert Speculation("off", lambda: None).plan([tree] * 2) == 1
    assert Speculation("always", lambda: None).plan([tree] * 16) == 8
    assert Speculation("auto", lambda: None).plan([Shape(1, 0, True)] * 2) == 1  # nothing drafted: no cost needed


def test_drafts_that_cost_time_to_make_are_priced_in(monkeypatch):
    """A drafter that pays per draft (a draft model's calls) gets a budget: the chain length the cost model would
    verify at this batch size with the drafts' own cost added; dear drafts shorten it, to the root alone."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    ms = {(b, t): 10.0 + b + 0.2 * b * (t - 1) for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8)}
    policy = Speculation("auto", lambda: _curve(ms))
    for _ in range(400):
        policy.observe("seq", _proposal([1, 2, 3, 4, 5, 6, 7, 8]), [2, 3, 4, 5, 6, 7, 8, 9])
    assert policy.budget(4, 8, draft_ms=0.0) == 8  # free drafts: the whole chain
    assert policy.budget(4, 8, draft_ms=50.0) == 1  # each draft costs more than a call: none
    assert {policy.budget(4, 8, draft_ms=50.0) for _ in range(2 * EXPLORE_EVERY)} == {1}  # under load: never explored
    assert policy.budget(1, 8, draft_ms=50.0) == 8  # alone, before a plain call was timed: the whole chain
    assert Speculation("off", lambda: None).budget(4, 8, 0.0) == 1


def test_a_drafter_that_prices_its_own_cuts_gets_the_best_cut_not_a_chains(monkeypatch):
    """A best-first tree's drafter gives the expected tokens of each cut (Shape.gains): the budget takes the cut with
    the most tokens per millisecond, which a chain's price (drafts down to depth t - 1) would misjudge."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    ms = {(b, t): 10.0 + b + 1.0 * b * (t - 1) for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8)}
    policy = Speculation("auto", lambda: _curve(ms))
    flat = (1.0, 1.6, 1.7, 1.75, 1.8, 1.85, 1.9, 1.95)  # the first node is worth the most, then little each
    steep = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 4.0, 8.0)  # the deep nodes are where the tokens are
    assert policy.budget(2, 8, 0.0, flat) == 2  # 3.2 tokens for 14 ms beats 3.6 for 20 and 3.9 for 28
    assert policy.budget(2, 8, 0.0, steep) == 8  # 16 tokens for 28 ms
    assert Speculation("always", lambda: None).budget(2, 8, 0.0, flat) == 8
    tree = Shape(8, 3, False, steep)
    assert policy._tokens(tree, 1) == 1.0 and policy._tokens(tree, 4) == 1.3 and policy._tokens(tree, 99) == 8.0


def test_a_lone_sequences_call_prices_are_robust_medians_and_never_fall_with_more_rows():
    lone = LoneCalls()
    lone.add(1, 5.0)
    assert lone.costs([1, 4]) is None  # no longer call timed yet
    lone.add(4, 30.0)  # a new shape's first call: slow
    assert lone.costs([1, 4]) == [5.0, 30.0]  # it prices the count until a second call comes
    for ms in (7.0, 7.2, 50.0, 6.8):  # then it is dropped, and one slow call moves the median little
        lone.add(4, ms)
    assert lone.costs([4]) == [pytest.approx(7.1)]
    for ms in (9.0, 8.0, 9.5):  # two rows timed dearer than four (a noisy count): averaged, not believed
        lone.add(2, ms)
    low, two, four = lone.costs([1, 2, 4])
    assert low == 5.0 and two == four and 7.1 < four < 9.0
    assert lone.costs([3, 8]) == [four, four]  # between counts interpolated, held past the last


def test_a_lone_sequence_prices_paid_drafts_by_its_own_steps():
    """Alone, a draft model's chain is priced by the times of the sequence's own calls, never by a measured curve
    (its first tokens wait for nothing): the whole chain until a plain call was timed (the EXPLORE_EVERY-th drafted
    step), then as far as pays; kept from drafting it drafts every EXPLORE_EVERY-th step, drafting it takes a plain
    step every REFRESH_PLAIN-th."""

    def no_curve():
        raise AssertionError("a lone sequence measured the cost curve")

    policy = Speculation("auto", no_curve)
    for _ in range(400):  # every other chain of 3 accepted whole, the others not at all: 1.5, 2, 2.5 expected
        policy.observe("seq", _proposal([1, 2, 3, 4]), [9])
        policy.observe("seq", _proposal([1, 2, 3, 4]), [2, 3, 4, 5])
    choices = []
    for _ in range(EXPLORE_EVERY):
        choices.append(policy.budget(1, 4, draft_ms=4.0))
        policy.timed(1, choices[-1], 0.010 if choices[-1] > 1 else 0.009)
    assert choices == [4] * (EXPLORE_EVERY - 1) + [1]  # drafting until a plain call is timed
    # at most 2.5 tokens for 10 + 3 x 4 ms against 1 for 9 ms: plain, but for a whole chain every EXPLORE_EVERY-th step
    choices = [policy.budget(1, 4, draft_ms=4.0) for _ in range(2 * EXPLORE_EVERY)]
    assert choices.count(1) == 2 * EXPLORE_EVERY - 2 and choices[EXPLORE_EVERY - 1] == 4 and choices[-1] == 4
    choices = [policy.budget(1, 4, draft_ms=0.1) for _ in range(REFRESH_PLAIN)]  # cheap drafts pay
    assert choices[:-1] == [4] * (REFRESH_PLAIN - 1) and choices[-1] == 1  # a plain call timed again
    assert Speculation("always", no_curve).budget(1, 4, draft_ms=50.0) == 4


def test_engine_drafting_is_skipped_where_plain_calls_pay(monkeypatch):
    """A graph that drafts the next trees pays for drafting in every call that does it: it drafts where drafting and
    verifying whole trees beats plain calls that draft nothing (small batches), not where each row costs its full
    price (16 rows); a lone sequence always drafts; `off` never, `always` always; a graph that cannot skip its
    drafting drafts every call."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    ms = {(b, t): 10.0 + b * (2 + (0.2 if b <= 2 else 1.0) * (t - 1)) for b in (1, 2, 4, 8, 16) for t in (1, 2, 4, 8)}
    plain = {b: 10.0 + b for b in (1, 2, 4, 8, 16)}  # drafting costs 1 ms per row on top of verifying
    policy = Speculation("auto", lambda: _curve(ms, plain=plain), plain_calls=True)
    tree, root = Shape(8, 3, False), Shape(1, 0, True)
    assert policy.drafts([tree])  # alone: no cost measured
    assert policy.drafts([tree] * 2) and policy.plan([tree] * 2) == 8
    assert not policy.drafts([tree] * 16)
    assert not policy.drafts([root] * 16)  # the drafts' shape is remembered while the rows decode plainly
    assert policy.drafts([root] * 2)  # fewer rows: drafting again
    assert (16, "plain") in policy.curve.calls and (16, 8) in policy.curve.calls
    assert not Speculation("off", plain_calls=True).drafts([tree] * 2)
    assert Speculation("always", plain_calls=True).drafts([tree] * 16)
    assert Speculation("auto", lambda: None).drafts([tree] * 16)  # no plain calls: the graph drafts anyway


def test_chains_are_verified_as_deep_as_pays(monkeypatch):
    """Chains can be cut to their first T tokens: with depth 1 almost always accepted and the rest never, T = 2 gives
    the most tokens per ms; a tree among the rows is verified whole or not at all, so the cut is not offered."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    ms = {(b, t): 10.0 * b * (1 + 0.1 * t) for b in (1, 2, 4) for t in (1, 2, 4, 8)}
    policy = Speculation("auto", lambda: _curve(ms, slots=4))
    for _ in range(400):
        policy.observe("seq", _proposal([1, 2, 3, 4, 5]), [2, 9])
    assert abs(policy.q[0] - 1) < 1e-3 and policy.q[1] < 1e-3
    chains = [Shape(8, 7, True), Shape(5, 4, True), Shape(1, 0, True), Shape(8, 7, True)]
    assert policy.plan(chains) == 2
    assert policy.plan([*chains[:3], Shape(8, 3, False)]) in (1, 8)


def test_shadows_learn_what_verification_would_have_accepted():
    """A proposal not verified (a plain step) is compared with the tokens its sequence emits next: it counts the
    drafts along its best-matching path, across steps, until one differs."""
    policy = Speculation("off")
    tree = _proposal([0, 5, 6, 7, 8], parents=[0, 0, 1, 2])  # paths 5-7 and 6-8
    policy.observe("a", tree, [6])  # plain step: 6 matches the second branch
    assert policy.q[0] == PRIOR_ACCEPTANCE  # not known yet
    policy.observe("a", _proposal([6]), [8])  # the next plain step: 8 -- the whole path matched
    assert policy.q[0] > PRIOR_ACCEPTANCE and policy.q[1] > PRIOR_ACCEPTANCE
    before = policy.q.copy()
    policy.observe("b", _proposal([0, 1, 2]), [3, 4])  # a drafted step that accepted nothing: known at once
    assert policy.q[0] < before[0] and policy.q[1] == before[1]
    q = policy.q  # the expected gains follow every update of q (they are kept between updates)
    assert policy.expected(2) == pytest.approx(1 + q[0] + q[0] * q[1]) and policy.expected(0) == 1.0
    assert policy.expected(3) == pytest.approx(1 + q[0] + q[0] * q[1] + q[0] * q[1] * PRIOR_ACCEPTANCE)
    policy.observe("c", _proposal([0, 1, 2]), [1])
    policy.forget("c")  # its sequence left: nothing more learnt from it
    assert "c" not in policy._shadows


def test_call_costs_are_measured_in_turns_on_a_grid_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path))
    ms = {(b, t): 10.0 * b + t for b in (1, 2, 4, 6) for t in (1, 2, 4, 6)}
    curve = _curve(ms, step_tokens=6, slots=6)
    assert curve.batch_grid == [1, 2, 4, 6]
    assert curve.cost(4, 5) == ms[4, 6]  # 5 tokens per row are priced as the engine's 6 (the next measured count)
    assert curve.costs(3, [1, 3]) == [(ms[2, 1] + ms[4, 1]) / 2, (ms[2, 4] + ms[4, 4]) / 2]  # between grid points
    measured = len(curve.calls)
    assert curve.calls[-4:] == [(4, 1), (4, 4)] * 2  # the token counts of one batch size timed in turns
    assert curve.cost(4, 6) == ms[4, 6] and len(curve.calls) == measured  # not measured again
    again = _curve(ms, step_tokens=6, slots=6)  # another process: from the user cache
    assert again.cost(4, 4) == ms[4, 4] and again.calls == [] and again.cached
    plain = {b: 5.0 * b for b in (1, 2, 4, 6)}
    skipping = _curve(ms, step_tokens=6, slots=6, plain=plain)  # a graph that can skip drafting: its own points
    assert skipping.plain_and_drafting(4) == (plain[4], ms[4, 6])
    assert set(skipping.calls) == {(2, "plain"), (4, "plain")}  # the drafting points came from the cache
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "other"))
    skipping = _curve(ms, step_tokens=6, slots=6, plain=plain)
    skipping.prepare(2)
    assert "2x1-plain" in skipping.to_dict()["points"]
    kept = _curve(ms, step_tokens=6, slots=6, plain=plain)
    assert kept.plain_and_drafting(2) == (plain[2], ms[2, 6]) and kept.calls == []
