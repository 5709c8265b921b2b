"""The `none` engine against transformers on tiny models of three shapes: logits, greedy ids, sampling, cache growth."""

import numpy as np
import pytest
import torch

from specbuild.runtime import engine as engine_module
from specbuild.runtime.engine import Engine, SamplingParams
from tests.conftest import TINY_SHAPES, hf_greedy, tiny_hf_model

pytestmark = pytest.mark.xdist_group("tiny")

PROMPTS = [[1, 5, 9, 13, 7, 22, 3], [1, 40, 41, 42], [1, 17]]


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_logits_match_transformers(tiny_engines, shape):
    engine = Engine(tiny_engines[shape], threads=1)
    model = tiny_hf_model(shape)
    ids = [1, 5, 9, 13, 7, 22, 3, 30, 11, 2, 4]
    got = engine.prefill_logits(ids)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_greedy_ids_equal_transformers_generate(tiny_engines, shape):
    engine = Engine(tiny_engines[shape], threads=1)
    model = tiny_hf_model(shape)
    for ids in PROMPTS:
        want = hf_greedy(model, ids, 40)
        result = engine.generate(input_ids=ids, max_new_tokens=40)
        assert result.output_ids == want
        assert result.mean_accepted_tokens == pytest.approx(1.0) or not result.accepted_per_step


def test_cache_growth_by_doubling_keeps_output_exact(tiny_engines, monkeypatch):
    monkeypatch.setattr(engine_module, "MIN_CAPACITY", 4)
    shape = "llama_gqa_llama3rope"
    engine = Engine(tiny_engines[shape], threads=1)
    grown = []
    real_ensure = engine_module.GrowingCache.ensure

    def spy(self, needed):
        before = self.capacity
        real_ensure(self, needed)
        if self.capacity != before:
            grown.append((before, self.capacity))

    monkeypatch.setattr(engine_module.GrowingCache, "ensure", spy)
    ids = [1, 5, 9]
    model = tiny_hf_model(shape)
    result = engine.generate(input_ids=ids, max_new_tokens=150)
    assert result.output_ids == hf_greedy(model, ids, 150)
    assert grown and all(after == 2 * before for before, after in grown)


def test_sampling_is_seeded_and_respects_filters(tiny_engines):
    engine = Engine(tiny_engines["qwen2_bias"], threads=1)
    a = engine.generate(input_ids=[1, 5, 9], max_new_tokens=30, sampling=SamplingParams(temperature=1.0, seed=7))
    b = engine.generate(input_ids=[1, 5, 9], max_new_tokens=30, sampling=SamplingParams(temperature=1.0, seed=7))
    c = engine.generate(input_ids=[1, 5, 9], max_new_tokens=30, sampling=SamplingParams(temperature=1.0, seed=8))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
    # top-k 1 is greedy whatever the temperature
    greedy = engine.generate(input_ids=[1, 5, 9], max_new_tokens=30)
    topk1 = engine.generate(
        input_ids=[1, 5, 9], max_new_tokens=30, sampling=SamplingParams(temperature=1.3, top_k=1, seed=3)
    )
    assert topk1.output_ids == greedy.output_ids


def test_stops_at_max_seq_len(tiny_engines):
    engine = Engine(tiny_engines["llama_tied_linear"], threads=1)
    limit = engine.max_seq_len
    result = engine.generate(input_ids=[1] + [5] * (limit - 10), max_new_tokens=100)
    assert result.stop_reason in ("max_seq_len", "eos")
    assert result.prompt_tokens + len(result.output_ids) <= limit + 1
