"""The `none` engine against transformers on tiny models of three shapes: logits, greedy ids, sampling, cache growth."""

import numpy as np
import pytest
import torch

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime import row_invariance
from specbuild.runtime import slots as slots_module
from specbuild.runtime.engine import Engine, SamplingParams
from specbuild.runtime.sampling import SamplingError
from tests.helpers import hf_greedy
from tests.shapes import TINY_ENGINE, TINY_ENGINE_SHAPES, tiny_hf_model

pytestmark = pytest.mark.xdist_group("tiny")

PROMPTS = [[1, 5, 9, 13, 7, 22, 3], [1, 40, 41, 42], [1, 17]]


@pytest.mark.parametrize("graph", [ef.BACKEND_ONNXRUNTIME, ef.BACKEND_TENSORRT])
@pytest.mark.parametrize("shape", TINY_ENGINE_SHAPES)
def test_logits_match_transformers(tiny_engines, shape, graph):
    """Both graphs: the one ONNX Runtime runs and the portable one TensorRT compiles (run here by ONNX Runtime)."""
    engine = Engine(tiny_engines[shape], threads=1, graph=graph)
    model = tiny_hf_model(shape)
    ids = [1, 5, 9, 13, 7, 22, 3, 30, 11, 2, 4]
    got = engine.prefill_logits(ids)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("shape", TINY_ENGINE_SHAPES)
def test_greedy_ids_equal_transformers_generate(tiny_engines, shape):
    engine = Engine(tiny_engines[shape], threads=1)
    model = tiny_hf_model(shape)
    for ids in PROMPTS:
        want = hf_greedy(model, ids, 40)
        result = engine.generate(input_ids=ids, max_new_tokens=40)
        assert result.output_ids == want
        assert result.mean_accepted_tokens == pytest.approx(1.0) or not result.accepted_per_step


def test_cache_growth_by_doubling_keeps_output_exact(tiny_engines, monkeypatch):
    monkeypatch.setattr(slots_module, "MIN_CAPACITY", 4)
    shape = TINY_ENGINE
    engine = Engine(tiny_engines[shape], threads=1)
    grown = []
    real_ensure = slots_module.SharedSlots.ensure

    def spy(self, needed):
        before = self.capacity
        real_ensure(self, needed)
        if self.capacity != before:
            grown.append((before, self.capacity))

    monkeypatch.setattr(slots_module.SharedSlots, "ensure", spy)
    ids = [1, 17]  # 100 tokens before an EOS: the slots grow from 4 to 128
    model = tiny_hf_model(shape)
    result = engine.generate(input_ids=ids, max_new_tokens=100)
    assert result.output_ids == hf_greedy(model, ids, 100)
    assert len(grown) >= 4 and all(after == 2 * before for before, after in grown)


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
    engine = Engine(tiny_engines[TINY_ENGINE], threads=1)
    limit = engine.max_seq_len
    result = engine.generate(input_ids=[1] + [5] * (limit - 10), max_new_tokens=100)
    assert result.stop_reason in ("max_seq_len", "eos")
    assert result.prompt_tokens + len(result.output_ids) <= limit + 1


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1e-30), "temperature"),
        (dict(temperature=1e39), "temperature"),  # not a finite float32
        (dict(temperature="0.5"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=2049), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_sampling_params_reject_values_out_of_range(kwargs, field):
    with pytest.raises(SamplingError, match=f"^{field} must be") as caught:
        SamplingParams(**kwargs)
    assert caught.value.field == field
    flag = "--" + field.replace("_", "-")
    with pytest.raises(SpecbuildError, match=f"^{flag} must be"):  # named the way the caller names it
        SamplingParams(**kwargs, names={field: flag})


def test_smallest_temperature_samples_and_bad_threads_or_lengths_are_refused(tiny_engines):
    engine = Engine(tiny_engines["qwen2_bias"], threads=1)
    greedy = engine.generate(input_ids=[1, 5, 9], max_new_tokens=10)
    cold = engine.generate(input_ids=[1, 5, 9], max_new_tokens=10, sampling=SamplingParams(temperature=1e-5, seed=3))
    assert cold.output_ids == greedy.output_ids  # T = 1e-5 on peaked logits: the argmax every time
    with pytest.raises(SpecbuildError, match="--max-new-tokens"):
        engine.generate(input_ids=[1, 5, 9], max_new_tokens=0)
    with pytest.raises(SpecbuildError, match="--threads"):
        Engine(tiny_engines["qwen2_bias"], threads=0)


def test_float_activation_engines_are_not_probed(tiny_engines, monkeypatch):
    """Float activations: rows differ at float rounding only; nothing to measure, no padding (runtime/exactness)."""
    monkeypatch.setattr(row_invariance, "probe_model", lambda *a, **k: pytest.fail("probed a float-activation engine"))
    engine = Engine(tiny_engines[TINY_ENGINE], threads=1)
    assert engine.lossless and engine.min_rows == 1 and "float activations" in engine.exactness.verified
