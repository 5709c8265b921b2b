"""In-flight batching: every request's output is its batch-1 output whatever joins, leaves, drafts or is cancelled
around it, for every mode at fp32 and int4; the scheduler's queue, chunked prefill, stop strings, streams, and the
speculation policy's choice by measured cost."""

import asyncio

import numpy as np
import pytest

from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine, SamplingParams
from specbuild.runtime.scheduler import Request, Scheduler
from specbuild.runtime.speculation import CostCurve, Speculation
from tests.conftest import ORT_ONLY, quiet

pytestmark = pytest.mark.xdist_group("batching")

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
DYNAMIC = dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8)
MODES = {"none": {}, "ngram": {}, "medusa": dict(tree=TREE), "eagle": DYNAMIC, "eagle3": DYNAMIC, "redrafter": {}}
WEIGHTS = ("fp32", "int4")

_rng = np.random.default_rng(0)
# 16 prompts of mixed lengths; repeats in them give prompt lookup something to copy
PROMPTS = [[int(x) for x in _rng.integers(1, 12, size=int(_rng.integers(2, 30)))] for _ in range(16)]


@pytest.fixture(scope="session")
def mode_engines(tmp_path_factory):
    """(mode, weights) -> engine dir: every mode on one toy model (12-token vocabulary, heads from the fixtures)."""
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.convert import convert_checkpoint
    from tests.plugins.eagle_fixtures import write_eagle1_head, write_eagle3_head
    from tests.plugins.medusa_helpers import toy_model, write_medusa_heads
    from tests.plugins.redrafter_fixtures import write_redrafter

    root = tmp_path_factory.mktemp("batching")
    model = toy_model("llama_gqa_llama3rope", root / "hf", seed=0)
    h = model.config.hidden_size
    write_medusa_heads(root / "medusa", "v2", h, 12, num_heads=3, seed=0)
    write_eagle1_head(root / "eagle", model.config, seed=0)
    write_eagle3_head(root / "eagle3", model.config, seed=0, draft_vocab=8)
    write_redrafter(root / "redrafter", h, 12, 4 * h, 2, True, "model.safetensors", seed=0)
    heads = {m: root / m for m in ("medusa", "eagle", "eagle3", "redrafter")}
    ckpt = convert_checkpoint(root / "hf", root / "ckpt", heads=heads, progress=False)
    engines = {}
    for mode, options in MODES.items():
        for weights in WEIGHTS:
            extra = {} if mode == "none" else {"speculative_mode": mode}
            opts = BuildOptions(backends=ORT_ONLY, weights=weights, max_seq_len=96, **extra, **options)
            engines[mode, weights] = build_engine(ckpt, root / f"{mode}-{weights}", opts, log=quiet)
    return engines


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


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("mode", list(MODES))
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


def test_seeded_sampling_ignores_what_was_drafted(mode_engines):
    """The same seed gives the same tokens whether the steps verify drafts or only roots (per-position uniforms)."""
    engine = Engine(mode_engines["medusa", "fp32"], threads=1)
    outputs = []
    for policy in ("always", "off"):
        _, handles = _batched(engine, 0.9, speculation=policy)
        outputs.append([h.output_ids for h in handles])
    assert outputs[0] == outputs[1]


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
    engine = Engine(mode_engines["none", "fp32"], threads=1)
    with pytest.raises(SpecbuildError, match="max_seq_len is 96"):
        engine.scheduler.submit(Request([1] * 96))
    with pytest.raises(SpecbuildError, match="max-batch-size 17"):
        Scheduler(engine, max_batch_size=17)
    # a request that reaches the context limit ends there
    result = engine.generate(input_ids=[1] * 90, max_new_tokens=50)
    assert result.stop_reason == "max_seq_len" and len(result.output_ids) == 96 - 90 + 1


def test_stop_strings_end_the_output_even_inside_a_step(mode_engines, monkeypatch):
    """A stop string completed by the second of three or more tokens accepted in one step ends the output there."""
    engine = Engine(mode_engines["medusa", "fp32"], threads=1)

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
        full = run(ids)
        steps = full.accepted_per_step
        multi = [i for i, n in enumerate(steps) if n >= 3]
        if multi:
            break
    else:
        pytest.fail("no step accepted three tokens")
    end = 1 + sum(steps[: multi[0]]) + 2  # output tokens up to the second token of that step
    stop = Letters().decode(full.output_ids[end - 2 : end])
    first = Letters().decode(full.output_ids).find(stop)  # it may occur earlier
    result = engine.result(run(ids, stop=(stop, "zzzz")))
    assert result.stop_reason == "stop"
    assert result.output_ids == full.output_ids[: first + 2]
    assert result.text == Letters().decode(full.output_ids)[:first]


def test_streams_give_each_request_only_its_new_tokens(mode_engines):
    engine = Engine(mode_engines["eagle", "fp32"], threads=1)
    scheduler = Scheduler(engine)
    seen: dict[int, list[int]] = {0: [], 1: []}
    a = scheduler.submit(Request(PROMPTS[0], max_new_tokens=20, on_tokens=seen[0].extend))
    b = scheduler.submit(Request(PROMPTS[1], max_new_tokens=25))
    chunks = list(b)  # iterating drives the scheduler
    assert all(chunks) and sum(chunks, []) == b.output_ids and len(b.output_ids) == 25
    a.wait()
    assert seen[0] == a.output_ids and len(a.output_ids) == 20


def test_async_stream_with_a_background_scheduler(mode_engines):
    engine = Engine(mode_engines["none", "fp32"], threads=1)
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


def _curve(ms: dict, step_tokens: int = 8) -> CostCurve:
    """A cost curve whose measurements are `ms[(b, t)]` (seconds = ms / 1000), counting the calls made."""
    calls = []

    def run_call(b, t):
        calls.append((b, t))
        return ms[b, t] / 1000

    curve = CostCurve(run_call, "test", "cpu", step_tokens)
    curve.calls = calls
    return curve


def test_speculation_follows_the_measured_cost(monkeypatch):
    """Drafting pays where extra rows are cheap (small batches) and not where each row costs its full price."""
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    cheap_rows = _curve({(1, 1): 10.0, (1, 8): 11.0, (16, 1): 20.0, (16, 8): 150.0})
    policy = Speculation("auto", lambda: cheap_rows)
    assert policy.draft([8])  # batch 1: 8 rows cost 10 % more, 1 + 0.5 * 7 tokens expected
    assert not policy.draft([8] * 16)  # batch 16: 7.5x the cost for 4.5x the tokens
    for _ in range(200):  # every draft accepted, many times over
        policy.observe([8], [8])
    assert policy.draft([8] * 16)
    assert not Speculation("off", lambda: cheap_rows).draft([8])
    assert Speculation("always", lambda: None).draft([8] * 16)
    assert not Speculation("auto", lambda: None).draft([1, 1])  # nothing drafted: no cost needed


def test_call_costs_are_measured_once_per_shape_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path))
    ms = {(b, t): 10.0 * b + t for b in (1, 2, 3) for t in (1, 2, 4, 6)}
    curve = _curve(ms, step_tokens=6)
    assert curve.cost(3, 5) == ms[3, 6]  # 5 tokens per row are priced as the engine's 6 (the next measured count)
    assert curve.cost(3, 3) == ms[3, 4] and curve.cost(1, 1) == ms[1, 1]
    measured = len(curve.calls)
    assert curve.cost(3, 6) == ms[3, 6] and len(curve.calls) == measured  # not measured again
    again = _curve(ms, step_tokens=6)  # another process: from the user cache
    assert again.cost(3, 4) == ms[3, 4] and again.calls == [] and again.cached
