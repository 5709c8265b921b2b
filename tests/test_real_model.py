"""SmolLM2-135M-Instruct (the embedded real model): engine logits and greedy ids against transformers."""

import numpy as np
import pytest
import torch

from specbuild import engine_format as ef
from specbuild.runtime.engine import Engine
from tests.helpers import quiet
from tests.tiers import full

pytestmark = [
    pytest.mark.xdist_group("real"),
    full("the real SmolLM2-135M model: a 135M engine and transformers' reference"),
]

PROMPTS = [
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "import numpy as np\n\ndef softmax(x):",
]


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_checkpoint, tmp_path_factory):
    from specbuild.builder.build import BuildOptions, build_engine

    return build_engine(
        smollm2_checkpoint,
        tmp_path_factory.mktemp("smollm2_none") / "engine",
        BuildOptions(max_seq_len=512, output_logits=True),
        log=quiet,
    )


@pytest.mark.parametrize("graph", [ef.BACKEND_ONNXRUNTIME, ef.BACKEND_TENSORRT])
def test_logits_match_transformers(smollm2_engine, smollm2_hf_model, graph):
    """Both graphs of the engine: the fused one ONNX Runtime runs and the portable one TensorRT would compile."""
    engine = Engine(smollm2_engine, graph=graph)
    ids = engine.codec.encode(PROMPTS[1])
    got = engine.prefill_logits(ids)
    with torch.no_grad():
        want = smollm2_hf_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() < 1e-4


def test_greedy_ids_equal_transformers(smollm2_engine, smollm2_greedy):
    engine = Engine(smollm2_engine)
    for prompt in PROMPTS:
        ids = engine.codec.encode(prompt)
        want = smollm2_greedy(ids, 64)
        result = engine.generate(input_ids=ids, max_new_tokens=64)
        assert result.output_ids == want, prompt
    assert engine.manifest["validation"]["max_abs_diff"] < 1e-3
