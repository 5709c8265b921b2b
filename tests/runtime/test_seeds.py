"""A seed means the same tokens: for every mode, as a chain and as a tree, each seeded sampled request gives the same
output twice on one engine, on freshly loaded engines, whatever the speculation policy decides (every step drafts,
none does, the cost model's choice: a lone draft model's by the wall-clock times of its own calls), and batched
with the others. (tests/serve/test_seeds.py: the same through `specbuild serve` with requests in flight together.)"""

import pytest

from specbuild.runtime.engine import Engine, SamplingParams
from specbuild.runtime.scheduler import Request, Scheduler
from tests.runtime.conftest import PROMPTS, VARIANTS
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("batching")

SETTINGS = {  # T = 1 with no filter, and a chat setting: T = 0.7 with top-k and top-p
    "T1": dict(temperature=1.0),
    "T0.7-top-k-top-p": dict(temperature=0.7, top_k=5, top_p=0.9),
}
REQUESTS = 10  # the first prompts, prompt i seeded with SEED + i
SEED = 40
FAST = ["draft-target", "draft-target-tree", "eagle3"]  # a paid drafter's chain and tree, an in-graph dynamic tree
OTHERS = "another mode or drafting: the fast tier checks draft-target's chain and tree and EAGLE-3's dynamic tree"


def requests(setting: str) -> list[Request]:
    return [
        Request(
            list(PROMPTS[i]), max_new_tokens=10 + 2 * i, sampling=SamplingParams(**SETTINGS[setting], seed=SEED + i)
        )
        for i in range(REQUESTS)
    ]


def alone(engine, setting: str, policy: str) -> tuple[list[list[int]], list[int]]:
    """(outputs, tokens accepted per decode step) of each request alone, with the speculation policy `policy`."""
    outputs, accepted = [], []
    for request in requests(setting):
        scheduler = Scheduler(engine, max_batch_size=1, speculation=policy)
        handle = scheduler.submit(request)
        handle.wait()
        assert handle.error is None, handle.error
        outputs.append(handle.output_ids)
        accepted += handle.accepted_per_step
    return outputs, accepted


def batched(engine, setting: str, policy: str) -> list[list[int]]:
    """Every request through one scheduler, joining a step or two apart (prompts prefilled in chunks beside
    decoding)."""
    scheduler = Scheduler(engine, prefill_chunk=7, speculation=policy)
    handles = []
    for i, request in enumerate(requests(setting)):
        handles.append(scheduler.submit(request))
        for _ in range(i % 3):
            scheduler.step()
    scheduler.run_until_idle()
    assert all(h.error is None for h in handles)
    return [h.output_ids for h in handles]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(
    "variant",
    [*FAST, *(pytest.param(v, marks=full(OTHERS)) for v in VARIANTS if v not in FAST)],
)
def test_a_seed_gives_the_same_tokens_whatever_was_drafted(mode_engines, variant, setting):
    path = mode_engines[variant, "fp32"]
    engine = Engine(path, threads=1)
    want, accepted = alone(engine, setting, "always")  # every step verifies the whole proposal
    if variant != "none":
        assert max(accepted) > 1, "no draft was accepted: the drafting paths were not exercised"
    assert any(out != want[0] for out in want[1:])  # the requests differ (sampled, seeded apart)
    assert alone(engine, setting, "always")[0] == want, "the same seeds again on the same engine"
    assert alone(Engine(path, threads=1), setting, "off")[0] == want, "roots only (plain decoding), fresh engine"
    assert alone(Engine(path, threads=1), setting, "auto")[0] == want, "the cost model's choice, fresh engine"
    for policy in ("always", "auto"):
        assert batched(engine, setting, policy) == want, f"batched, {policy}"
