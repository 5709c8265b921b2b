"""The architectures beyond Llama, Mistral and Qwen2 (shapes.ARCH_SHAPES) against transformers: the config is read
as transformers reads it, the `none` engine gives transformers' prefill logits and greedy ids (64 tokens, prompts
longer than any sliding window), and every kind of drafter reproduces them; sampling keeps the base distribution."""

import pytest

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.runtime.engine import Engine
from specbuild.runtime.scheduler import Request, Scheduler
from tests.helpers import ORT_ONLY, assert_drafting_behind_an_if, check_none_engine, hf_greedy, quiet
from tests.plugins.distribution_check import check_sampled_distribution, exact_distribution
from tests.plugins.eagle_fixtures import write_eagle3_head
from tests.plugins.medusa_helpers import toy_model, write_medusa_heads
from tests.shapes import ARCH_SHAPES, tiny_hf_model
from tests.tiers import full

SEEDS = (0, 1, 2)
PROMPTS = [[1, 5, 9, 3, 7, 11, 4, 8, 10, 6], [1, 4, 10]]
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
MODE_OPTIONS = {
    "ngram": dict(num_draft_tokens=3),
    "lookahead": dict(),
    "medusa": dict(tree=TREE),
    "eagle3": dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8),
}


def _read_as_transformers(cfg, hf_config) -> None:
    """The canonical config holds what transformers' modeling code reads from the same config.json."""
    assert cfg.head_dim == (
        getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    )
    assert cfg.num_kv_heads == hf_config.num_key_value_heads
    kinds = getattr(hf_config, "layer_types", None)
    if kinds is None:  # Phi-3: one window on every layer when it has one
        kinds = ["full_attention" if hf_config.sliding_window is None else "sliding_attention"] * cfg.num_layers
    assert cfg.sliding_layers == [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    if cfg.sliding_layers:
        assert cfg.sliding_window == hf_config.sliding_window


@full("another architecture: the fast tier's tiny engine is the Qwen2 shape")
@pytest.mark.parametrize("shape,seed", [(s, seed) for s in ARCH_SHAPES for seed in SEEDS])
def test_none_engine_equals_transformers(tmp_path, shape, seed):
    model = tiny_hf_model(shape, seed=seed, eos_token_id=None)
    model.save_pretrained(tmp_path / "hf")
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    _read_as_transformers(Checkpoint.load(ckpt).model, model.config)
    check_none_engine(model, ckpt, tmp_path / "engine", PROMPTS, 64)


@full("a Phi-3 engine across LongRoPE's switch, batched: the fast tier's Phi-3 engines cross it alone")
def test_longrope_engines_recompute_the_cache_where_transformers_does(tmp_path):
    """Past original_max_position_embeddings transformers' Phi-3 rotates every position with the long factors, its
    cache recomputed once; an engine gives its greedy ids from prompts below, at and past the switch, alone and in
    one batch whose prompts are prefilled in chunks (rows on either side of the switch in the same calls)."""
    shape = "phi3_longrope"
    model = tiny_hf_model(shape, eos_token_id=None)
    model.save_pretrained(tmp_path / "hf")
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    switch = ARCH_SHAPES[shape][2]["original_max_position_embeddings"]
    options = BuildOptions(backends=ORT_ONLY, max_seq_len=3 * switch, speculative_mode="ngram", num_draft_tokens=3)
    engine = Engine(build_engine(ckpt, tmp_path / "engine", options, log=quiet), threads=1)
    assert engine.layout.rope_switch == switch
    prompts = [[1 + i % 80 for i in range(n)] for n in (7, switch - 1, switch, switch + 1, 2 * switch)]
    want = [hf_greedy(model, p, switch) for p in prompts]
    for prompt, ids in zip(prompts, want):
        assert engine.generate(input_ids=prompt, max_new_tokens=switch).output_ids == ids, len(prompt)
    scheduler = Scheduler(engine, prefill_chunk=switch // 3, speculation="always")
    handles = [scheduler.submit(Request(p, max_new_tokens=switch)) for p in prompts]
    scheduler.run_until_idle()
    assert [h.output_ids for h in handles] == want
    assert max(n for h in handles for n in h.accepted_per_step) > 1  # drafts were verified on both sides


def _mode_engine(tmp_path, shape: str, mode: str, vocab: int = 12, seed: int = 1):
    model = toy_model(shape, tmp_path / "hf", vocab=vocab, seed=seed)
    heads = {}
    if mode == "medusa":
        write_medusa_heads(tmp_path / "head", "v2", model.config.hidden_size, vocab, num_heads=3, seed=seed)
        heads = {mode: tmp_path / "head"}
    elif mode == "eagle3":
        write_eagle3_head(tmp_path / "head", model.config, draft_vocab=8, seed=seed)
        heads = {mode: tmp_path / "head"}
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads=heads, progress=False)
    options = BuildOptions(backends=ORT_ONLY, speculative_mode=mode, **MODE_OPTIONS[mode])
    return model, Engine(build_engine(ckpt, tmp_path / "engine", options, log=quiet), threads=1)


HEAD_MODES = ("eagle3", "ngram", "lookahead", "medusa")


@full("a drafter on another architecture: the modes run on tiny shapes")
@pytest.mark.parametrize("shape,mode", [(s, m) for m in HEAD_MODES for s in ARCH_SHAPES])
def test_speculative_engine_equals_transformers(tmp_path, shape, mode):
    model, engine = _mode_engine(tmp_path, shape, mode)
    if mode in ("eagle3", "medusa"):  # engine-drafted: plain calls skip the drafting (Gemma's scaled embedding too)
        assert_drafting_behind_an_if(engine.path / engine.graph["file"])
    steps = []
    for prompt in PROMPTS:
        result = engine.generate(input_ids=prompt, max_new_tokens=40)
        assert result.output_ids == hf_greedy(model, prompt, 40)
        steps += result.accepted_per_step
    assert max(steps) > 1  # drafts were accepted


@full("a sampled distribution (3000 samples): the fast tier checks it on the Llama shapes")
@pytest.mark.parametrize("shape", [next(iter(ARCH_SHAPES)), "gemma3_untied"])  # the second soft-caps its logits
def test_sampling_preserves_the_base_distribution(tmp_path, shape):
    model, engine = _mode_engine(tmp_path, shape, "ngram", vocab=8, seed=3)
    prompt, n, samples = [1, 5, 3, 1, 5, 3, 1], 3, 3000
    exact = exact_distribution(model, prompt, n, 1.0, 0, 1.0)
    check_sampled_distribution(engine, prompt, n, samples, exact, 1.0, 0, 1.0)
