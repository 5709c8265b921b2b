"""The base network without its decoder layers' weights in memory, for checkpoints of any size.

- `skeleton`: the layers' parameters are fake (shapes and dtypes only: torch's FakeTensorMode), so the step graph is
  exported without holding them; `layer_weight` makes each one from the checkpoint when the graph is written
  (export.py writes them one at a time).
- `streamed`: each layer parameter is read from the checkpoint whenever the forward reads it (a torch
  parametrization) and dropped after: the torch reference that validation compares the graphs with, in the memory of
  one layer.

The embedding, the final norm and the lm_head are real in both (the largest single tensors; modes read them when
they are built, e.g. Medusa's draft-vocabulary rows of the lm_head), and so are the rotary tables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from specbuild.builder.model_config import ModelConfig
from specbuild.builder.network import TORCH_DTYPES, LlamaNetwork

# the packed projections of a decoder layer and the checkpoint tensors they stack (network.py: pack_qkv,
# pack_gate_up); the unpacked modules stay in the layer, unused by its forward
PACKED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
UNPACKED = tuple(f"{part}." for parts in PACKED.values() for part in parts)
LAYER_PARAMETER = re.compile(r"layers\.(\d+)\.(.+)")


def layer_weight(tensors: Mapping, index: int, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Parameter `name` (e.g. `self_attn.qkv_proj.weight`) of packed decoder layer `index`, from the checkpoint's
    tensors (HF names), in `dtype`."""
    module, _, kind = name.rpartition(".")
    parts = PACKED.get(module, (module,))
    return torch.cat([tensors[f"model.layers.{index}.{part}.{kind}"] for part in parts]).to(dtype)


def network_weight(tensors: Mapping, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A layer parameter of the network by its name in LlamaNetwork (`layers.3.mlp.down_proj.weight`)."""
    match = LAYER_PARAMETER.fullmatch(name)
    if match is None:
        raise KeyError(f"{name} is not a decoder-layer parameter")
    return layer_weight(tensors, int(match.group(1)), match.group(2), dtype)


def layer_parameters(layer: nn.Module) -> list[str]:
    """The parameters a packed decoder layer's forward reads (not the unpacked projections it was packed from)."""
    return [name for name, _ in layer.named_parameters() if not name.startswith(UNPACKED)]


def _base(cfg: ModelConfig, tensors: Mapping, dtype: str, real_from: LlamaNetwork | None = None) -> LlamaNetwork:
    """The network with meta (no memory) decoder layers, packed, and its real embedding, norm, lm_head and rotary
    frequencies in `dtype` (those of `real_from` if given: the modules are shared, not copied)."""
    torch_dtype = TORCH_DTYPES[dtype]
    with torch.device("meta"):
        net = LlamaNetwork(cfg).to(torch_dtype)
    for layer in net.layers:
        layer.self_attn.pack_qkv()
        layer.mlp.pack_gate_up()
    if real_from is not None:
        net.embed_tokens, net.norm, net.lm_head = real_from.embed_tokens, real_from.norm, real_from.lm_head
        net.register_buffer("inv_freq", real_from.inv_freq, persistent=False)
        return net.eval()
    embed = tensors["model.embed_tokens.weight"].to(torch_dtype)
    net.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    net.norm.weight = nn.Parameter(tensors["model.norm.weight"].to(torch_dtype), requires_grad=False)
    head = tensors["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"].to(torch_dtype)
    net.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta", dtype=torch_dtype)
    net.lm_head.weight = nn.Parameter(head.clone() if cfg.tie_word_embeddings else head, requires_grad=False)
    inv_freq, _ = cfg.rope_frequencies()
    net.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
    return net.eval()


def skeleton(cfg: ModelConfig, tensors: Mapping, dtype: str = "float32", real_from=None) -> LlamaNetwork:
    """The network to export: decoder-layer parameters fake (written later by layer_weight), the rest real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    net = _base(cfg, tensors, dtype, real_from)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    for layer in net.layers:
        for name in layer_parameters(layer):
            owner, _, attr = name.rpartition(".")
            module = layer.get_submodule(owner)
            param = getattr(module, attr)
            with fake:
                placeholder = torch.empty(param.shape, dtype=param.dtype)
            setattr(module, attr, nn.Parameter(placeholder, requires_grad=False))
    return net


class _FromCheckpoint(nn.Module):
    """A parametrization that reads one layer parameter from the checkpoint each time it is read."""

    def __init__(self, tensors: Mapping, index: int, name: str, dtype: torch.dtype):
        super().__init__()
        self.tensors, self.index, self.name, self.dtype = tensors, index, name, dtype

    def forward(self, _placeholder):
        return layer_weight(self.tensors, self.index, self.name, self.dtype)


def streamed(cfg: ModelConfig, tensors: Mapping, dtype: str = "float32", real_from=None) -> LlamaNetwork:
    """The network as a torch reference: each decoder-layer parameter read from the checkpoint when used."""
    net = _base(cfg, tensors, dtype, real_from)
    torch_dtype = TORCH_DTYPES[dtype]
    for index, layer in enumerate(net.layers):
        for name in layer_parameters(layer):
            owner, _, attr = name.rpartition(".")
            module = layer.get_submodule(owner)
            parametrize.register_parametrization(
                module, attr, _FromCheckpoint(tensors, index, name, torch_dtype), unsafe=True
            )
    return net
