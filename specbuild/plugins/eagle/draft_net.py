"""The EAGLE-1/2 draft network: fc over (token embedding, final normed hidden), LLaMA decoder layers (layer 0
without input_layernorm), logits from the base lm_head or the head's own reduced-vocabulary projection."""

from __future__ import annotations

import torch
from torch import nn

from specbuild.builder.network.llama import RMSNorm
from specbuild.plugins.feature_draft.draft_net import DraftAttention, DraftMLP, DraftNet


class Eagle1Layer(nn.Module):
    """LlamaDecoderLayer; EAGLE's layer 0 has no input_layernorm."""

    def __init__(self, c, input_norm: bool):
        super().__init__()
        h = c["hidden"]
        self.input_layernorm = RMSNorm(h, c["rms_norm_eps"]) if input_norm else None
        self.self_attn = DraftAttention(h, h, c["num_heads"], c["num_kv_heads"], c["head_dim"], c["qkv_bias"])
        self.post_attention_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.mlp = DraftMLP(h, c["intermediate_size"])

    def forward(self, x, emb, cos, sin, mem_k, mem_v, mem_mask, self_mask):
        y = self.input_layernorm(x) if self.input_layernorm is not None else x
        a, k, v = self.self_attn(y, cos, sin, mem_k, mem_v, mem_mask, self_mask)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Eagle1Net(DraftNet):
    version = 1

    def __init__(self, head_cfg: dict, base_cfg):
        super().__init__(head_cfg, base_cfg)
        h = base_cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bool(head_cfg.get("fc_bias", True)))
        self.layers = nn.ModuleList(Eagle1Layer(self.c, input_norm=i > 0) for i in range(int(head_cfg["num_layers"])))
        self.has_lm_head = self.draft_vocab is not None
        if self.has_lm_head:
            self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)

    def graph_features(self, ctx):
        return ctx.hidden  # the base's final normed hidden state

    def layer_input(self, emb, feats):
        return self.fc(torch.cat([emb, feats], dim=-1))

    def logits(self, h, net):
        return self.lm_head(h) if self.has_lm_head else net.lm_head(h)
