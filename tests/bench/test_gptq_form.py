"""The GPTQ form of a checkpoint: weights within half a quantization step, read the same way by ONNX Runtime GenAI's
own GPTQ loader, every other tensor and file carried over."""

import json

import pytest
import torch
from safetensors import safe_open

from specbuild.bench.checkpoints import write_checkpoint
from specbuild.bench.gptq_form import dequantize_linear, quantize_linear, write_gptq_form


def test_weights_within_half_a_step():
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    tensors = quantize_linear(weight, group_size=32)
    assert tensors["qweight"].shape == (8, 48) and tensors["qzeros"].shape == (2, 6)
    assert tensors["scales"].shape == (2, 48) and tensors["scales"].dtype == torch.float16
    step = tensors["scales"].float()[tensors["g_idx"].long()].T  # [out, in]
    error = (dequantize_linear(tensors) - weight).abs()
    assert (error <= step / 2 + 1e-6).all()
    assert not torch.equal(dequantize_linear(tensors), weight)  # it is quantized


def test_genai_loader_reads_the_same_weights():
    loaders = pytest.importorskip("onnxruntime_genai.models.loaders.gptq")
    from onnxruntime_genai.models.loaders.base import QuantizedTensorModule

    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 0.02
    tensors = quantize_linear(weight, group_size=32)
    module = QuantizedTensorModule()
    for key, value in tensors.items():
        setattr(module, key, value.clone())
    module.bits, module.group_size = 4, 32
    reader = loaders.GPTQModel.__new__(loaders.GPTQModel)  # its unpacking methods alone, no checkpoint
    reader.set_quantized_tensor_properties(module)
    reader.prepare_quantized_tensor(module)
    reader.unpack(module)
    assert (module.in_features, module.out_features) == (96, 64)
    torch.testing.assert_close(module.qweight.float(), dequantize_linear(tensors), atol=1e-3, rtol=1e-3)


def test_odd_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\[8, 40\] weight: its inputs must split into groups of 32"):
        quantize_linear(torch.zeros(8, 40), group_size=32)


def test_a_refused_checkpoint_leaves_nothing(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 40)}, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="groups of 32"):
        write_gptq_form(src, tmp_path / "gptq", log=lambda *_: None)
    assert not (tmp_path / "gptq").exists()
    with pytest.raises(FileNotFoundError, match="no config.json and"):
        write_gptq_form(tmp_path / "missing", tmp_path / "gptq")


def test_checkpoint_keeps_other_tensors_and_files(tmp_path):
    src = write_checkpoint("tiny-llama", tmp_path / "hf", num_layers=1, log=lambda *_: None)
    dst = write_gptq_form(src, tmp_path / "gptq", log=lambda *_: None)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                             "desc_act": False}  # fmt: skip
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    with safe_open(str(src / "model.safetensors"), "pt") as a, safe_open(str(dst / "model.safetensors"), "pt") as b:
        names = set(b.keys())
        for name in a.keys():
            if name.endswith("_proj.weight"):
                stem = name.removesuffix(".weight")
                assert {f"{stem}.{k}" for k in ("qweight", "qzeros", "scales", "g_idx")} <= names
                assert name not in names
            else:
                assert torch.equal(a.get_tensor(name), b.get_tensor(name))
