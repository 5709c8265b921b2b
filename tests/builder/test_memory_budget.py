"""builder/memory_budget.py: an engine the machine cannot hold is refused before any work, saying what would fit."""

import pytest

from specbuild.builder import memory_budget
from specbuild.builder.build import build_engine
from specbuild.builder.options import BuildOptions
from specbuild.errors import SpecbuildError


def llama_8b_shapes() -> dict:
    """Tensor shapes of Llama-3.1-8B (untied, 32 layers, GQA 32/8, intermediate 14336, vocabulary 128256)."""
    h, inter, kv, vocab = 4096, 14336, 1024, 128256
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(32):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}  # fmt: skip
    return shapes


def test_engine_bytes_follow_the_precision():
    shapes = llama_8b_shapes()
    sizes = {w: memory_budget.engine_bytes(shapes, shapes.get, w, 32, False) for w in memory_budget.PRECISIONS}
    params = sum(a * (b if len(s) == 2 else 1) for s in shapes.values() for a, b in [(s[0], s[-1])])
    assert 8.0e9 < params < 8.1e9
    assert sizes["fp32"] == pytest.approx(4 * params, rel=1e-3)
    assert sizes["fp16"] == pytest.approx(2 * params, rel=1e-3)
    assert 0.55 * params < sizes["int4"] < 0.7 * params  # packed values, scales, zero points
    assert 1.3 * params < sizes["int8"] < 1.4 * params  # and a float32 embedding


def test_an_8b_fp32_engine_is_refused_on_24_gib_saying_what_fits():
    shapes = llama_8b_shapes()
    with pytest.raises(SpecbuildError) as info:
        memory_budget.check_fits(shapes, shapes.get, "fp32", 32, False, 24 * 1024**3)
    message = str(info.value)
    assert "\n" not in message and "--weights fp32" in message and "32.1 GB" in message
    assert "--weights int4" in message and "--weights int8" in message and "would fit" in message
    assert "fp16 (" in message  # 16 GB of fp16 weights fit in 24 GiB too
    sizes = memory_budget.check_fits(shapes, shapes.get, "int4", 32, False, 24 * 1024**3)
    assert sizes["int4"] < 6e9
    assert memory_budget.check_fits(shapes, shapes.get, "fp32", 32, False, None)["fp32"] > 3e10  # no meminfo


def test_nothing_fits_says_so():
    shapes = llama_8b_shapes()
    with pytest.raises(SpecbuildError, match="no precision fits"):
        memory_budget.check_fits(shapes, shapes.get, "int4", 32, False, 1024**3)


def test_build_refuses_before_writing_anything(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 1024)
    out = tmp_path / "engine"
    with pytest.raises(SpecbuildError, match=r"--weights fp32: the engine holds .* more than the 0.0 GB"):
        build_engine(tiny_checkpoints["qwen2_bias"], out, BuildOptions(speculative_mode="none"))
    assert not out.exists()
