"""The architectures beyond Llama, Mistral and Qwen2 (conftest.ARCH_SHAPES) against transformers: the config is read
as transformers reads it, the `none` engine gives transformers' prefill logits and greedy ids (64 tokens, prompts
longer than any sliding window), and every kind of drafter reproduces them; sampling keeps the base distribution."""

import pytest

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint import Checkpoint
from specbuild.builder.convert import convert_checkpoint
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine
from tests.conftest import ARCH_SHAPES, ORT_ONLY, check_none_engine, fast_first, full, hf_greedy, quiet, tiny_hf_model
from tests.plugins.distribution_check import check_sampled_distribution, exact_distribution
from tests.plugins.eagle_fixtures import write_eagle3_head
from tests.plugins.medusa_helpers import toy_model, write_medusa_heads

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


@pytest.mark.parametrize(
    "shape,seed",
    fast_first([(s, seed) for s in ARCH_SHAPES for seed in SEEDS], "another shape or seed: the fast tier checks one"),
)
def test_none_engine_equals_transformers(tmp_path, shape, seed):
    model = tiny_hf_model(shape, seed=seed, eos_token_id=None)
    model.save_pretrained(tmp_path / "hf")
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    _read_as_transformers(Checkpoint.load(ckpt).model, model.config)
    check_none_engine(model, ckpt, tmp_path / "engine", PROMPTS, 64)


@full("a Phi-3 engine run to its last position: the fast tier builds one Qwen3 engine per test here")
def test_longrope_engines_stop_where_transformers_recomputes_the_cache(tmp_path):
    """Past original_max_position_embeddings transformers' Phi-3 re-rotates every cached key with the long factors;
    a build that would reach it is refused in one line, and one that stops there serves every position exactly."""
    shape = "phi3_longrope"
    model = tiny_hf_model(shape, eos_token_id=None)
    model.save_pretrained(tmp_path / "hf")
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    original = ARCH_SHAPES[shape][2]["original_max_position_embeddings"]
    assert Checkpoint.load(ckpt).model.exact_positions()[0] == original
    with pytest.raises(SpecbuildError, match=f"between 2 and {original}: LongRoPE") as info:
        build_engine(ckpt, tmp_path / "too-long", BuildOptions(max_seq_len=original + 1), log=quiet)
    assert "\n" not in str(info.value) and not (tmp_path / "too-long").exists()
    engine = Engine(build_engine(ckpt, tmp_path / "engine", BuildOptions(backends=ORT_ONLY), log=quiet), threads=1)
    assert engine.max_seq_len == original  # the default stops there too
    prompt = [1, 5, 9, 3, 7, 11, 4, 8, 10, 6]
    result = engine.generate(input_ids=prompt, max_new_tokens=original)
    # the last token comes from position original - 1's logits: transformers made it with the short factors too
    assert result.stop_reason == "max_seq_len" and len(prompt) + len(result.output_ids) == original + 1
    assert result.output_ids == hf_greedy(model, prompt, len(result.output_ids))


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


@pytest.mark.parametrize(
    "shape,mode",
    fast_first(
        [(s, m) for m in ("eagle3", "ngram", "lookahead", "medusa") for s in ARCH_SHAPES],
        "another drafter or architecture: the fast tier checks one head mode",
    ),
)
def test_speculative_engine_equals_transformers(tmp_path, shape, mode):
    model, engine = _mode_engine(tmp_path, shape, mode)
    steps = []
    for prompt in PROMPTS:
        result = engine.generate(input_ids=prompt, max_new_tokens=40)
        assert result.output_ids == hf_greedy(model, prompt, 40)
        steps += result.accepted_per_step
    assert max(steps) > 1  # drafts were accepted


@full("a sampled distribution (3000 samples): the fast tier checks it on the Llama shapes")
def test_sampling_preserves_the_base_distribution(tmp_path):
    shape = next(iter(ARCH_SHAPES))
    model, engine = _mode_engine(tmp_path, shape, "ngram", vocab=8, seed=3)
    prompt, n, samples = [1, 5, 3, 1, 5, 3, 1], 3, 3000
    exact = exact_distribution(model, prompt, n, 1.0, 0, 1.0)
    check_sampled_distribution(engine, prompt, n, samples, exact, 1.0, 0, 1.0)
