"""The streaming safetensors writer: what the safetensors library reads back, tensor for tensor, any dtype."""

import pytest
import torch
from safetensors.torch import load_file

from specbuild.builder.checkpoint.safetensors_stream import write_safetensors
from specbuild.errors import SpecbuildError


def test_the_library_reads_back_every_tensor_and_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.fp16": torch.randn(2, 2, 2, generator=g).to(torch.float16),
        "ids": torch.arange(11),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
    }
    specs = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    made = []
    size = write_safetensors(tmp_path / "x.safetensors", specs, lambda name: made.append(name) or tensors[name])
    assert made == list(tensors)  # produced one at a time, in order
    assert size == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_a_tensor_that_does_not_match_its_declaration_is_refused(tmp_path):
    specs = {"a": ((2, 2), torch.float32)}
    with pytest.raises(SpecbuildError, match="tensor a came out"):
        write_safetensors(tmp_path / "x.safetensors", specs, lambda name: torch.zeros(2, 3))
