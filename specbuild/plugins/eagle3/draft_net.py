"""The EAGLE-3 draft network: fc over three captured decoder-layer inputs (low, mid, high), one midlayer over
(embedding, feature) of width 2H, its own norm and reduced-vocabulary lm_head (draft id -> target id by d2t)."""

from __future__ import annotations

import torch
from torch import nn

from specbuild.builder.network.llama import RMSNorm
from specbuild.plugins.feature_draft.draft_net import DraftAttention, DraftMLP, DraftNet


class Eagle3Layer(nn.Module):
    """EAGLE-3 midlayer: attention over cat(input_layernorm(embedding), hidden_norm(x)) (width 2H).

    The attention output is added to x, or with norm_before_residual (speculators/vLLM) to hidden_norm(x)."""

    def __init__(self, c):
        super().__init__()
        h = c["hidden"]
        self.norm_before_residual = bool(c.get("norm_before_residual", False))
        self.input_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.hidden_norm = RMSNorm(h, c["rms_norm_eps"])
        self.self_attn = DraftAttention(2 * h, h, c["num_heads"], c["num_kv_heads"], c["head_dim"], False)
        self.post_attention_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.mlp = DraftMLP(h, c["intermediate_size"])

    def forward(self, x, emb, cos, sin, mem_k, mem_v, mem_mask, self_mask):
        normed = self.hidden_norm(x)
        y = torch.cat([self.input_layernorm(emb), normed], dim=-1)
        a, k, v = self.self_attn(y, cos, sin, mem_k, mem_v, mem_mask, self_mask)
        x = (normed if self.norm_before_residual else x) + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Eagle3Net(DraftNet):
    version = 3

    def __init__(self, head_cfg: dict, base_cfg):
        super().__init__(head_cfg, base_cfg)
        h = base_cfg.hidden_size
        target_h = head_cfg.get("target_hidden_size") or h
        self.fc = nn.Linear(3 * target_h, h, bias=False)
        self.midlayer = Eagle3Layer(self.c)
        self.layers = [self.midlayer]
        self.norm = RMSNorm(h, self.c["rms_norm_eps"])
        self.lm_head = nn.Linear(h, self.draft_vocab or base_cfg.vocab_size, bias=False)

    def graph_features(self, ctx):
        return torch.cat(ctx.captured, dim=-1)  # the inputs of the captured base layers, low | mid | high

    def project(self, feats):
        return self.fc(feats)

    def logits(self, h, net):
        return self.lm_head(self.norm(h))
