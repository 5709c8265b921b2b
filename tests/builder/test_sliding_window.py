"""Sliding-window attention (Mistral on every layer, Qwen2 on layers >= max_window_layers) against transformers, with
prompts and outputs far longer than the window: the `none` engine and every speculative mode reproduce the base
model's greedy ids exactly, and the windowed graph passes the TensorRT operator check."""

import pytest

from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, check_none_engine, hf_greedy, quiet
from tests.plugins.eagle_fixtures import write_eagle1_head, write_eagle3_head
from tests.plugins.medusa_helpers import toy_model, write_medusa_heads
from tests.shapes import SLIDING_SHAPES, tiny_hf_model
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("sliding")

# windows are 5 (mistral) and 4 (qwen2): prompts longer and shorter than them, 40 new tokens each
PROMPTS = [[1, 5, 9, 3, 7, 11, 4, 8, 10, 6], [1, 4, 10]]
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
MODE_OPTIONS = {
    "medusa": dict(tree=TREE),
    "eagle": dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8),
    "eagle3": dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8),
}


@full("sliding windows: engines of their own (Mistral's, Gemma 3's window patterns)")
@pytest.mark.parametrize("shape", SLIDING_SHAPES)
def test_none_engine_equals_transformers_beyond_the_window(tmp_path, shape):
    model = tiny_hf_model(shape, eos_token_id=None)
    model.save_pretrained(tmp_path / "hf")
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    cfg = Checkpoint.load(ckpt).model
    kwargs = SLIDING_SHAPES[shape][2]
    assert cfg.sliding_window == kwargs["sliding_window"]
    want_layers = list(range(kwargs.get("max_window_layers", 0), kwargs["num_hidden_layers"]))
    assert cfg.sliding_layers == want_layers
    check_none_engine(model, ckpt, tmp_path / "engine", PROMPTS, 40)


# every mode on a sliding model, both window patterns covered (one export per case keeps the suite short)
@pytest.mark.parametrize(
    "shape,mode", [("qwen2_window", "medusa"), ("mistral_window", "eagle"), ("qwen2_window", "eagle3")]
)
@full("a speculative engine per window pattern")
def test_speculative_engine_equals_transformers_beyond_the_window(tmp_path, shape, mode):
    model = toy_model(shape, tmp_path / "hf", vocab=12, seed=1)
    if mode == "medusa":
        write_medusa_heads(tmp_path / "head", "v2", model.config.hidden_size, 12, num_heads=3, seed=1)
    elif mode == "eagle":
        write_eagle1_head(tmp_path / "head", model.config, seed=1, qkv_bias=shape.startswith("qwen2"))
    else:
        write_eagle3_head(tmp_path / "head", model.config, draft_vocab=8, seed=1)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={mode: tmp_path / "head"}, progress=False)
    options = BuildOptions(backends=ORT_ONLY, speculative_mode=mode, **MODE_OPTIONS[mode])
    engine = Engine(build_engine(ckpt, tmp_path / "engine", options, log=quiet), threads=1)
    steps = []
    for prompt in PROMPTS:
        result = engine.generate(input_ids=prompt, max_new_tokens=40)
        assert result.output_ids == hf_greedy(model, prompt, 40)
        steps += result.accepted_per_step
    assert max(steps) > 1  # multi-token commits happened across the window boundary
