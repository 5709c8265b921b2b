"""The base network without its weights in memory, for checkpoints of any size.

- `skeleton`: the weights (the decoder layers', the embedding, the lm_head) are fake (shapes and dtypes only: torch's
  FakeTensorMode), so the step graph is exported without holding them; `network_weight` makes each one from the
  checkpoint when the graph is written (ir_weights.py writes them one at a time).
- `streamed`: each of them is read from the checkpoint whenever the forward reads it (a torch parametrization) and
  dropped after: the torch reference the graphs are checked against, in the memory of one layer and the largest
  tensor; `holding(budget)` keeps them across forwards up to a budget (a validation of several calls, in the memory
  the graph's session just gave back).

The final norm and the rotary tables are real in both (small); a mode that copies lm_head rows when it is built
(Medusa's draft vocabulary) reads them through `output_weight()`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils import parametrize

from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.checkpoint.torch_dtypes import FLOAT_DTYPES
from specbuild.builder.network.llama import LlamaNetwork, norm_offset

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
    return torch.cat(_layer_parts(tensors, index, name)).to(dtype)


def _layer_parts(tensors: Mapping, index: int, name: str) -> list[torch.Tensor]:
    module, _, kind = name.rpartition(".")
    return [tensors[f"model.layers.{index}.{part}.{kind}"] for part in PACKED.get(module, (module,))]


EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"  # the large parameters outside the layers


def network_weight(tensors: Mapping, name: str, dtype: torch.dtype, tied: bool = False) -> torch.Tensor:
    """A weight of the network by its name in LlamaNetwork (`layers.3.mlp.down_proj.weight`, `embed_tokens.weight`,
    `lm_head.weight`: the embedding's where `tied`)."""
    match = LAYER_PARAMETER.fullmatch(name)
    if match is not None:
        return layer_weight(tensors, int(match.group(1)), match.group(2), dtype)
    return weight_parts(tensors, name, tied)[0].to(dtype)


def weight_parts(tensors: Mapping, name: str, tied: bool = False) -> list[torch.Tensor]:
    """The checkpoint's tensors, as read (not converted), whose concatenation along their first axis is network
    weight `name` (several for a packed projection: qkv_proj, gate_up_proj)."""
    if name == EMBED or (name == LM_HEAD and tied):
        return [tensors["model.embed_tokens.weight"]]
    if name == LM_HEAD:
        return [tensors["lm_head.weight"]]
    match = LAYER_PARAMETER.fullmatch(name)
    if match is None:
        raise KeyError(f"{name} is not a weight the network reads from the checkpoint")
    return _layer_parts(tensors, int(match.group(1)), match.group(2))


def layer_parameters(layer: nn.Module) -> list[str]:
    """The parameters a packed decoder layer's forward reads (not the unpacked projections it was packed from)."""
    return [name for name, _ in layer.named_parameters() if not name.startswith(UNPACKED)]


class LazyNetwork(LlamaNetwork):
    """LlamaNetwork whose weights are not held (see the module): it knows where to read them."""

    # where the weights come from, never what a step graph's trace reads (builder/export/trace_cache.py)
    untraced_attributes = ("tensors", "_held", "_hold_left", "_source")

    def __init__(self, cfg: ModelConfig, tensors: Mapping, dtype: str):
        super().__init__(cfg)
        self.tensors, self.weight_dtype = tensors, FLOAT_DTYPES[dtype]
        self._held: dict[str, torch.Tensor] | None = None  # weights kept while holding() (the tied ones once)
        self._hold_left = 0
        self._source = None  # while reading(): source(name) -> the weight in this dtype, or None (the checkpoint's)

    def weight(self, name: str) -> torch.Tensor:
        sourced = self._sourced(name)
        if sourced is not None:
            return sourced
        return network_weight(self.tensors, name, self.weight_dtype, self.cfg.tie_word_embeddings)

    def weight_parts(self, name: str) -> list[torch.Tensor] | None:
        """weight(name) before its conversion to the network's dtype, as the checkpoint tensors it joins
        (`weight_parts`); None while reading() gives the weights."""
        if self._source is not None:
            return None
        return weight_parts(self.tensors, name, self.cfg.tie_word_embeddings)

    def _key(self, name: str) -> str:
        return EMBED if name == LM_HEAD and self.cfg.tie_word_embeddings else name

    def _sourced(self, name: str) -> torch.Tensor | None:
        return self._source(self._key(name)) if self._source is not None else None

    @contextmanager
    def reading(self, source):
        """Within: weights are source(name) where that is not None (the engine's own file, as written: a view of
        it, builder/export/weights_ahead.py), else read from the checkpoint."""
        self._source = source
        try:
            yield self
        finally:
            self._source = None

    @contextmanager
    def holding(self, budget: int):
        """Within: the weights the forward reads are kept once read, up to `budget` bytes (the first ones read), so
        that several forwards read and convert them once: a converted copy costs more than the forward itself."""
        self._held, self._hold_left = {}, budget
        try:
            yield self
        finally:
            self._held, self._hold_left = None, 0

    def read_weight(self, name: str) -> torch.Tensor:
        """weight(name), kept while holding() has room, unless reading() gives it (a view of a file: made again for
        nothing, and kept it would keep the file's pages mapped)."""
        if self._held is None:
            return self.weight(name)
        key = self._key(name)
        value = self._held.get(key)
        if value is None:
            sourced = self._sourced(name)
            if sourced is not None:
                return sourced
            value = self.weight(name)
            size = value.numel() * value.element_size()
            if size <= self._hold_left:
                self._held[key], self._hold_left = value, self._hold_left - size
        return value

    def output_weight(self) -> torch.Tensor:
        return self.weight(LM_HEAD)

    def lazy_parameters(self) -> list[str]:
        """The network's weights read from the checkpoint (the rest, norms and tables, are held)."""
        names = [EMBED, LM_HEAD]
        for index, layer in enumerate(self.layers):
            names += [f"layers.{index}.{name}" for name in layer_parameters(layer)]
        return names


def _base(cfg: ModelConfig, tensors: Mapping, dtype: str) -> LazyNetwork:
    """The network with meta (no memory) weights, packed, and its real final norm and rotary frequencies."""
    torch_dtype = FLOAT_DTYPES[dtype]
    tensors = norm_offset(cfg, tensors)
    with torch.device("meta"):
        net = LazyNetwork(cfg, tensors, dtype).to(torch_dtype)
    for layer in net.layers:
        layer.self_attn.pack_qkv()
        layer.mlp.pack_gate_up()
    net.norm.weight = nn.Parameter(tensors["model.norm.weight"].to(torch_dtype), requires_grad=False)
    net.set_rope_buffers()
    return net.eval()


def _replace(net: LazyNetwork, name: str, make) -> None:
    """Parameter `name` of the network replaced by make(module, attribute, meta parameter, name)."""
    owner, _, attr = name.rpartition(".")
    module = net.get_submodule(owner)
    make(module, attr, getattr(module, attr), name)


def skeleton(cfg: ModelConfig, tensors: Mapping, dtype: str = "float32") -> LazyNetwork:
    """The network to export: its weights fake (written later by network_weight), norms and tables real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    net = _base(cfg, tensors, dtype)
    fake = FakeTensorMode(allow_non_fake_inputs=True)

    def make(module, attr, param, name):
        with fake:
            placeholder = torch.empty(param.shape, dtype=param.dtype)
        setattr(module, attr, nn.Parameter(placeholder, requires_grad=False))

    for name in net.lazy_parameters():
        _replace(net, name, make)
    return net


class _FromCheckpoint(nn.Module):
    """A parametrization that reads one weight from the checkpoint each time it is read."""

    def __init__(self, net: LazyNetwork, name: str):
        super().__init__()
        self.read = lambda: net.read_weight(name)  # not a submodule: the network would own itself

    def forward(self, _placeholder):
        return self.read()


def streamed(cfg: ModelConfig, tensors: Mapping, dtype: str = "float32") -> LazyNetwork:
    """The network as a torch reference: each weight read from the checkpoint when used."""
    net = _base(cfg, tensors, dtype)

    def make(module, attr, param, name):
        parametrize.register_parametrization(module, attr, _FromCheckpoint(net, name), unsafe=True)

    for name in net.lazy_parameters():
        _replace(net, name, make)
    return net
