"""Fused projections (Phi-3's qkv_proj and gate_up_proj) split at convert time: the parts are the fused rows in
transformers' order, and a fused tensor that is missing or of the wrong shape is one error naming it."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.builder.checkpoint.fused_tensors import unfuse
from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.errors import SpecbuildError
from tests.shapes import tiny_hf_model

SHAPE = "phi3_window"


def test_parts_are_the_fused_rows_in_transformers_order():
    model = tiny_hf_model(SHAPE)
    cfg = ModelConfig.from_hf(model.config.to_dict())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    parts = unfuse(cfg, state, "m")
    layer = model.model.layers[1]
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    qkv = layer.self_attn.qkv_proj.weight
    p = "model.layers.1."
    assert torch.equal(parts[p + "self_attn.q_proj.weight"], qkv[:q])
    assert torch.equal(parts[p + "self_attn.k_proj.weight"], qkv[q : q + kv])
    assert torch.equal(parts[p + "self_attn.v_proj.weight"], qkv[q + kv :])
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2, dim=0)  # Phi3MLP: gate first
    assert torch.equal(parts[p + "mlp.gate_proj.weight"], gate) and torch.equal(parts[p + "mlp.up_proj.weight"], up)
    assert set(parts) - {"lm_head.weight"} == set(cfg.expected_shapes())  # tied: the state dict repeats it


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda s: s.pop("model.layers.0.mlp.gate_up_proj.weight"), "gate_up_proj.weight is missing"),
        (
            lambda s: s.update({"model.layers.1.self_attn.qkv_proj.weight": torch.zeros(60, 32)}),
            "qkv_proj.weight has shape (60, 32), expected (64, 32)",
        ),
    ],
)
def test_a_bad_fused_tensor_is_named(tmp_path, change, needle):
    tiny_hf_model(SHAPE).save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    change(state)
    save_file(state, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(SpecbuildError, match=r"hf: tensor model\.layers\.\d\.") as info:
        convert_checkpoint(tmp_path / "hf", tmp_path / "out", progress=False)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
