"""The network's packed projections: one MatMul for gate and up (and for q, k, v) computes what the separate
projections compute, without holding the weights twice."""

import pytest
import torch

from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.network.llama import LlamaNetwork
from tests.shapes import tiny_hf_model


@pytest.mark.parametrize("shape,overrides", [("llama_gqa_llama3rope", {}), ("llama_tied_linear", {"mlp_bias": True})])
def test_packed_gate_up_is_the_two_projections(shape, overrides):
    hf = tiny_hf_model(shape, **overrides)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    assert cfg.mlp_bias == bool(overrides.get("mlp_bias"))
    net = LlamaNetwork.from_tensors(cfg, dict(hf.state_dict()))
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(net.layers, hf.model.layers):
        mlp = ours.mlp
        assert mlp.gate_up_proj is not None
        # the separate projections are views of the packed weight: no second copy
        assert mlp.gate_proj.weight.data_ptr() == mlp.gate_up_proj.weight.data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_proj.weight.untyped_storage().data_ptr()
        with torch.no_grad():
            torch.testing.assert_close(mlp.gate_proj.weight, theirs.mlp.gate_proj.weight, rtol=0, atol=0)
            torch.testing.assert_close(mlp.up_proj.weight, theirs.mlp.up_proj.weight, rtol=0, atol=0)
            torch.testing.assert_close(mlp(x), theirs.mlp(x), rtol=1e-5, atol=1e-6)
