"""A seeded request to `specbuild serve` under load (several requests in flight together, the server's own speculation
policy deciding what each step drafts) gives the tokens the same request gives alone in `specbuild run`, with every
step drafting or none: for draft-target's chain and tree, and (full tier) the other tree and chain drafters."""

import asyncio

import pytest
import torch

from tests.helpers import ORT_ONLY, Lazy, quiet, write_char_tokenizer
from tests.serve.conftest import ServerProcess
from tests.shapes import tiny_hf_model
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("serve")

PROMPTS = ["abc", "hello world", "x", "def f(a, b):", "1 2 3 4 5 1 2 3", "The quick brown fox", "zz", "q r s"]
SETTINGS = {  # request fields: T = 1 with no filter, and a chat setting with top-k and top-p
    "T1": dict(temperature=1.0),
    "T0.7-top-k-top-p": dict(temperature=0.7, top_p=0.9, extra_body={"top_k": 20}),
}
VARIANTS = {
    "draft-target": dict(speculative_mode="draft-target", num_draft_tokens=3),
    "draft-target-tree": dict(speculative_mode="draft-target", draft_top_k=2, draft_depth=2),
    "eagle3": dict(speculative_mode="eagle3", eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8),
    "ngram-tree": dict(speculative_mode="ngram", ngram_candidates=2, num_draft_tokens=3),
}
FAST = ("draft-target-tree",)  # the runtime tests (tests/runtime/test_seeds.py) check its chain too


@pytest.fixture(scope="module")
def seed_engines(tmp_path_factory):
    """variant -> engine dir: a tiny Llama with a character tokenizer (no EOS: every request runs to max_tokens), an
    EAGLE-3 head and a draft model (the target with its last MLP damped, the same tokenizer)."""
    from specbuild.builder.build import BuildOptions, build_engine
    from specbuild.builder.checkpoint.convert import convert_checkpoint
    from tests.plugins.eagle_fixtures import write_eagle3_head

    root = tmp_path_factory.mktemp("serve_seeds")
    model = tiny_hf_model("llama_gqa_llama3rope", eos_token_id=None)
    model.save_pretrained(root / "hf")
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.mul_(0.6)
    model.save_pretrained(root / "draft")
    for path in (root / "hf", root / "draft"):
        write_char_tokenizer(path)
    write_eagle3_head(root / "eagle3-head", model.config, seed=0, draft_vocab=32)
    heads = {"draft-target": root / "draft", "eagle3": root / "eagle3-head"}
    ckpt = convert_checkpoint(root / "hf", root / "ckpt", heads=heads, progress=False)

    def make(variant):
        options = BuildOptions(backends=ORT_ONLY, max_seq_len=128, **VARIANTS[variant])
        return build_engine(ckpt, root / variant, options, log=quiet)

    return Lazy(make)


def alone(engine_dir, setting: str, policy: str) -> list[str]:
    """Each request alone in this process (`specbuild run`'s path), with the speculation policy `policy`."""
    from specbuild.runtime.engine import Engine, SamplingParams

    engine = Engine(engine_dir, threads=1, speculation=policy)
    fields = dict(SETTINGS[setting])
    top_k = fields.pop("extra_body", {}).get("top_k", 0)
    texts = []
    for i, prompt in enumerate(PROMPTS):
        sampling = SamplingParams(**fields, top_k=top_k, seed=100 + i)
        texts.append(engine.generate(prompt=prompt, max_new_tokens=20, sampling=sampling).text)
    return texts


async def in_flight(server, setting: str) -> list[str]:
    """Every request at once through the server."""
    client = server.async_client()
    responses = await asyncio.gather(
        *(
            client.completions.create(
                model=server.model, prompt=prompt, max_tokens=20, seed=100 + i, **SETTINGS[setting]
            )
            for i, prompt in enumerate(PROMPTS)
        )
    )
    await client.close()
    return [r.choices[0].text for r in responses]


@pytest.mark.parametrize(
    "variant", [*FAST, *(pytest.param(v, marks=full("another drafter served")) for v in VARIANTS if v not in FAST)]
)
def test_seeded_requests_in_flight_give_their_solo_tokens(seed_engines, variant, tmp_path, monkeypatch):
    engine_dir = seed_engines[variant]
    want = {setting: alone(engine_dir, setting, "always") for setting in SETTINGS}
    for setting, texts in want.items():
        assert len(set(texts)) > 1
        assert alone(engine_dir, setting, "off") == texts, setting  # plain decoding
    for policy in ("always", "auto"):  # every step drafts; the server's default, the cost model's choice
        monkeypatch.setenv("SPECBUILD_SPECULATION", policy)
        server = ServerProcess(engine_dir, tmp_path / f"log-{policy}").wait_ready()
        try:
            for setting, texts in want.items():
                for round_ in range(2):
                    assert asyncio.run(in_flight(server, setting)) == texts, (policy, setting, round_)
            if policy == "always":
                assert server.metric("specbuild:spec_decode_num_accepted_tokens_total") > 0
        finally:
            server.close()
