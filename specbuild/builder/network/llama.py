"""Our own Llama-family network (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) over an explicit KV tensor and a
tree mask.

One forward serves prefill and tree decode: T new tokens attend to the first `past_length` cache
positions and to the new tokens their `tree_mask` row allows. It returns the KV of the new tokens
only; the runtime commits the accepted ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from specbuild.builder.checkpoint.model_config import ModelConfig
from specbuild.builder.checkpoint.torch_dtypes import FLOAT_DTYPES
from specbuild.builder.network.layers import RMSNorm, apply_rope, stacked_linear


class NormOffset(Mapping):
    """The checkpoint's tensors with `offset` added to every RMSNorm weight (in float32), for the architectures whose
    norms scale by (offset + weight) (Gemma: 1 + weight): the network's RMSNorm then scales by the weight it reads."""

    def __init__(self, tensors: Mapping, offset: float):
        self.tensors, self.offset = tensors, offset

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.tensors[name]
        return value.float() + self.offset if name.endswith("norm.weight") else value

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def norm_offset(cfg: ModelConfig, tensors: Mapping) -> Mapping:
    """`tensors` as the network reads them: NormOffset where the architecture has one."""
    return NormOffset(tensors, cfg.norm_offset) if cfg.norm_offset else tensors


class Attention(nn.Module):
    """GQA attention with RoPE. project() and attend() are shared with the EAGLE draft layers."""

    def __init__(
        self,
        in_dim: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        bias: bool,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        scale: float | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale  # of the attention scores
        self.custom_scale = scale is not None
        self.q_proj = nn.Linear(in_dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.qkv_proj: nn.Linear | None = None  # set by pack_qkv()
        if qk_norm_eps is not None:  # Qwen3: RMSNorm over each query / key head, before RoPE
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x, cos, sin):
        """q [B,Hq,T,D], k/v [B,Hkv,T,D] with RoPE applied to q and k."""
        b, t, _ = x.shape
        d = self.head_dim
        if self.qkv_proj is not None:  # one MatMul (both graphs then hold the same, shareable packed weight)
            sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
            q, k, v = torch.split(self.qkv_proj(x), sizes, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.norm_heads(self.q_norm, q.reshape(b, t, self.num_heads, d)).transpose(1, 2)
        k = self.norm_heads(self.k_norm, k.reshape(b, t, self.num_kv_heads, d)).transpose(1, 2)
        v = v.reshape(b, t, self.num_kv_heads, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    @staticmethod
    def norm_heads(norm: RMSNorm | None, x):
        """x [..., heads, D] with each head RMS-normalised (Qwen3's q_norm / k_norm), or x without a norm."""
        return x if norm is None else norm(x)

    def normed_qkv(self, qkv):
        """The packed projection qkv [B,T,(Hq+2Hkv)D] with q_norm / k_norm applied to its query and key heads (the
        fused attention kernel rotates what it is given); qkv itself without them."""
        if self.q_norm is None:
            return qkv
        b, t, _ = qkv.shape
        d, hq, hkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
        q = self.q_norm(q.reshape(b, t, hq, d)).reshape(b, t, hq * d)
        k = self.k_norm(k.reshape(b, t, hkv, d)).reshape(b, t, hkv * d)
        return torch.cat([q, k, v], dim=-1)

    def attend(self, q, keys, values, mask):
        """q [B,Hq,T,D]; keys/values: lists of [B,Hkv,M_i,D] chunks (cache, new tokens, ...); mask [B,1,1,T,sum M_i]
        bool -> o_proj output [B,T,H]."""
        return self.o_proj(self.attend_heads(q, keys, values, mask))

    def attend_heads(self, q, keys, values, mask):
        """attend() before the output projection: [B,T,Hq*D].

        Scores are computed per chunk and only they are concatenated (T x M, not the M x D keys and values), so
        the KV cache is never copied into a longer tensor."""
        b, _, t, d = q.shape
        hkv, g = self.num_kv_heads, self.num_heads // self.num_kv_heads
        q = q.reshape(b, hkv, g, t, d)
        scores = torch.cat([torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) for k in keys], dim=-1) * self.scale
        scores = scores.float().masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values[0].dtype)
        chunks = torch.split(probs, [k.shape[2] for k in keys], dim=-1) if len(keys) > 1 else (probs,)
        out = torch.matmul(chunks[0], values[0].unsqueeze(2))  # [B,Hkv,G,T,D]
        for p, v in zip(chunks[1:], values[1:]):
            out = out + torch.matmul(p, v.unsqueeze(2))
        return out.reshape(b, self.num_heads, t, d).transpose(1, 2).reshape(b, t, self.num_heads * d)

    def kernel_scale(self) -> dict:
        """GroupQueryAttention's `scale` attribute where the scale is not its default 1 / sqrt(head_dim)."""
        return {"scale": float(self.scale)} if self.custom_scale else {}

    def pack_qkv(self) -> None:
        """Project q, k and v with one packed Linear from now on (see packed_qkv)."""
        self.qkv_proj = self.packed_qkv()

    def packed_qkv(self):
        """The q/k/v projections as one [x -> q|k|v] Linear (ONNX Runtime's GroupQueryAttention takes packed QKV)."""
        return stacked_linear(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, mask, past_k, past_v):
        """x [B,T,H]; cos/sin [B,1,T,D]; mask [B,1,1,T,C+T] bool; past_k/v [B,Hkv,C,D]."""
        q, k, v = self.project(x, cos, sin)
        out = self.attend(q, [past_k, k], [past_v, v], mask)
        return out, k, v


ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu": nn.functional.gelu,
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        bias = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.gate_up_proj: nn.Linear | None = None  # set by pack_gate_up()

    def forward(self, x):
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = torch.split(self.gate_up_proj(x), self.gate_proj.out_features, -1)
        return self.down_proj(self.act(gate) * up)

    def pack_gate_up(self) -> None:
        """Project gate and up with one [x -> gate|up] Linear from now on: one weight-only MatMul kernel instead of two
        (with int8 activations the input is also quantized once), ~4 % of the MLP's time on a one-token int4 step.
        Each output column is the same dot product as before. gate_proj/up_proj keep views of the packed weight, so
        the weights are not held twice."""
        lin = stacked_linear(self.gate_proj, self.up_proj)
        inter = self.gate_proj.out_features
        for i, proj in enumerate((self.gate_proj, self.up_proj)):
            proj.weight = nn.Parameter(lin.weight[i * inter : (i + 1) * inter], requires_grad=False)
            if lin.bias is not None:
                proj.bias = nn.Parameter(lin.bias[i * inter : (i + 1) * inter], requires_grad=False)
        self.gate_up_proj = lin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        h = cfg.hidden_size
        self.self_attn = Attention(
            h,
            h,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.attention_bias,
            cfg.o_proj_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
            scale=cfg.attention_scale,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm norms the attention output; these wrap the MLP
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm of the MLP's input."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def attention_output(self, a):
        """What the attention adds to the residual stream."""
        return self.post_attention_layernorm(a) if self.sandwich else a

    def mlp_output(self, m):
        """What the MLP adds to the residual stream."""
        return self.post_feedforward_layernorm(m) if self.sandwich else m

    def forward(self, x, cos, sin, mask, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + self.attention_output(a)
        x = x + self.mlp_output(self.mlp(self.mlp_norm(x)))
        return x, k, v


class ScaledEmbedding(nn.Embedding):
    """Embedding rows times `scale` rounded to the weight's dtype first (Gemma's sqrt(hidden_size), as transformers'
    Gemma3TextScaledWordEmbedding multiplies): what the layers and every draft network reading it get."""

    def __init__(self, vocab: int, hidden: int, scale: float):
        super().__init__(vocab, hidden)
        self.scale = scale
        # the factor as each floating dtype holds it, made here (on the CPU: a skeleton is built on "meta"): a
        # tensor made from Python data while a graph is traced is a constant, which the exporter cannot take inside
        # an If branch (the drafting reads the embedding)
        self._rounded = {
            dtype: float(torch.tensor(scale, dtype=torch.float32, device="cpu").to(dtype))
            for dtype in (torch.float32, torch.float16, torch.bfloat16)
        }

    def forward(self, input_ids):
        x = super().forward(input_ids)
        return x * self._rounded[x.dtype]


class TiedOutput(nn.Module):
    """An lm_head that is the embedding's matrix E [V,H]: logits = x @ E^T over rows flattened to 2D, which the
    exporter writes as Gemm(x, E, transB=1) on E itself: the graph holds E once (the Gather and the Gemm read it)
    instead of E and a transposed copy, a vocabulary-sized matrix less to write, hash and load."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # not a submodule: the embedding is the network's

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] (no rows: [0, V])
        weight = self.weight
        return nn.functional.linear(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[0])


class LlamaNetwork(nn.Module):
    """Base model. forward() -> (final hidden [B,T,H] after the last norm, new_kv [L,2,B,Hkv,T,D], layer inputs).

    capture_layers lists layer indices whose input (the residual stream entering that layer, HF hidden_states[i])
    is returned; index L means the last layer's output before the final norm.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = (
            nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            if cfg.embedding_scale is None
            else ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embedding_scale)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.set_rope_buffers()

    def set_rope_buffers(self) -> None:
        """The RoPE frequencies from the config, a real float32 tensor (a network made on the meta device gets them
        again)."""
        inv_freq, self.rope_scaling_factor = self.cfg.rope_frequencies()
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        if self.cfg.sliding_rope_theta is not None:  # Gemma 3: the sliding layers' own base (default type)
            local = self.cfg.sliding_rope_frequencies()
            self.register_buffer("sliding_inv_freq", local.to(torch.float32), persistent=False)

    def use_long_rope(self) -> LlamaNetwork:
        """Take a per-row ef.ROPE_LONG flag (forward's long_rope): flagged rows rotate with LongRoPE's long factors
        (ModelConfig.rope_switch). Before use_fused_kernels: its tables then hold both sets."""
        self.register_buffer("long_inv_freq", self.cfg.long_rope_frequencies().to(torch.float32), persistent=False)
        return self

    @property
    def long_rope(self) -> bool:
        """Whether forward takes long_rope (use_long_rope)."""
        return getattr(self, "long_inv_freq", None) is not None

    def local_rope(self, layer: int) -> bool:
        """Whether decoder layer `layer` rotates with the sliding layers' RoPE (ModelConfig.sliding_rope_theta)."""
        return self.cfg.sliding_rope_theta is not None and layer in self.cfg.sliding_layers

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, tensors: dict, dtype: str = "float32") -> LlamaNetwork:
        with torch.device("meta"):  # no random initialisation: every weight is loaded below
            net = cls(cfg)
        net = net.to_empty(device="cpu")
        net.set_rope_buffers()
        state = {}
        offset = norm_offset(cfg, tensors)
        for name in tensors:
            state[name.removeprefix("model.")] = offset[name]
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        net.load_state_dict(state, strict=True)
        net = net.to(FLOAT_DTYPES[dtype]).eval()
        for layer in net.layers:
            layer.self_attn.pack_qkv()
            layer.mlp.pack_gate_up()
        return net

    def tie_output(self) -> None:
        """Tied embeddings read by the lm_head itself (TiedOutput): a float graph stores the [V,H] matrix once."""
        self.lm_head = TiedOutput(self.embed_tokens)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's logits of hidden states x [..., H] after the final norm: the lm_head, soft-capped where the
        config says (Gemma's final_logit_softcapping)."""
        logits = self.lm_head(x)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def output_weight(self) -> torch.Tensor:
        """The lm_head weight [V,H] with its values (builder/network/lazy_network.py's networks read it from the
        checkpoint): what a mode copies rows of when it is built (Medusa's draft vocabulary)."""
        return self.lm_head.weight.detach()

    def rope(self, position_ids, dtype, local: bool = False, long_rope=None):
        """cos/sin [B,1,T,R] of the full-attention layers' RoPE, or the sliding layers' (`local`, default type);
        long_rope [B] bool: the rows rotated with LongRoPE's long factors (use_long_rope)."""
        inv_freq = self.sliding_inv_freq if local else self.inv_freq
        freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B,T,R/2] (R: the rotary dims, usually D)
        if long_rope is not None and not local:
            long_freqs = position_ids.float().unsqueeze(-1) * self.long_inv_freq
            freqs = torch.where(long_rope.view(-1, 1, 1), long_freqs, freqs)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [B,1,T,R]
        cos, sin = emb.cos(), emb.sin()
        if (
            self.rope_scaling_factor != 1.0 and not local
        ):  # yarn's attention factor, applied to cos/sin like transformers
            cos, sin = cos * self.rope_scaling_factor, sin * self.rope_scaling_factor
        return cos.to(dtype), sin.to(dtype)

    @staticmethod
    def attention_mask(tree_mask, past_length, capacity: int, position_ids=None, window: int | None = None):
        """[B,1,1,T,C+T] bool: cache positions < past_length, plus the tree among new tokens.

        With a sliding `window`, a query at position p also needs key position > p - window (cache slot j holds
        position j; new tokens carry position_ids), as transformers' sliding-window mask."""
        b, t, _ = tree_mask.shape
        cache_pos = torch.arange(capacity, device=tree_mask.device)
        past = (cache_pos.unsqueeze(0) < past_length.unsqueeze(1)).unsqueeze(1).expand(b, t, capacity)
        new = tree_mask
        if window is not None:
            lowest = (position_ids - window).unsqueeze(2)  # [B,T,1]: keys must lie above it
            past = past & (cache_pos.view(1, 1, capacity) > lowest)
            new = new & (position_ids.unsqueeze(1) > lowest)
        return torch.cat([past, new], dim=2).unsqueeze(1).unsqueeze(1)

    def use_fused_kernels(self, max_positions: int) -> LlamaNetwork:
        """Prepare forward_fused(): packed QKV per layer and rotary tables for positions < max_positions."""
        from specbuild.builder.network.ort_kernels import check_rotary_dims, rotary_tables

        check_rotary_dims(self.cfg.rotary_dim or self.cfg.head_dim, self.cfg.head_dim)

        for layer in self.layers:
            if layer.self_attn.qkv_proj is None:
                layer.self_attn.pack_qkv()
        dtype = self.norm.weight.dtype
        cos, sin = rotary_tables(self.inv_freq, self.rope_scaling_factor, max_positions, dtype)
        if self.long_rope:  # the long factors' rows after the short ones': a flagged row reads them (rotary_positions)
            long_cos, long_sin = rotary_tables(self.long_inv_freq, self.rope_scaling_factor, max_positions, dtype)
            cos, sin = torch.cat([cos, long_cos]), torch.cat([sin, long_sin])
        self.rotary_rows = max_positions
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        if self.cfg.sliding_rope_theta is not None:
            cos, sin = rotary_tables(self.sliding_inv_freq, 1.0, max_positions, dtype)
            self.register_buffer("sliding_rotary_cos", cos, persistent=False)
            self.register_buffer("sliding_rotary_sin", sin, persistent=False)
        return self

    def rotary(self, layer: int):
        """(cos, sin) tables [P, R/2] decoder layer `layer` rotates with (forward_fused); [2P, R/2] with the long
        factors' rows after the short ones' (use_long_rope)."""
        if self.local_rope(layer):
            return self.sliding_rotary_cos, self.sliding_rotary_sin
        return self.rotary_cos, self.rotary_sin

    def rotary_positions(self, layer: int, position_ids, long_rope):
        """The rows of layer `layer`'s tables its tokens read: position_ids, plus P on the long-flagged rows."""
        if long_rope is None or self.local_rope(layer):
            return position_ids
        return position_ids + long_rope.view(-1, 1).to(position_ids.dtype) * self.rotary_rows

    def forward_fused(
        self,
        input_ids,
        position_ids,
        tree_mask,
        past_length,
        kv_buffers,
        capture_layers=(),
        causal_chain=False,
        attention_pad=0,
        min_rows=None,
        long_rope=None,
    ):
        """The ONNX Runtime form of forward(): kv_buffers = [k_0, v_0, k_1, ...] each [B,Hkv,C,D], written in place.

        causal_chain: the caller only ever feeds tokens at positions past..past+T-1 with a causal tree_mask (plain
        decoding, chain drafts), so attention takes the kernel's own causal mask and sliding window (no bias).
        attention_pad: attention attends at least attention_pad + 1 rows (copies of the last token after it).
        min_rows: a tensor whose length M pads the whole call to at least M rows (step padding; see ort_kernels).
        The buffers need room for the pad rows after the tokens.
        long_rope [B] bool: the rows rotated with LongRoPE's long factors (use_long_rope).
        Returns (final hidden [B,T,H], [present k_0, v_0, ...], layer inputs [B,T,H]), the buffers with the new
        tokens' keys and values at [past_length, past_length + T) (see ort_kernels)."""
        from specbuild.builder.network.ort_kernels import (
            attention_bias,
            group_query_attention,
            padded_rows,
            skip_rms_norm,
        )

        tokens = input_ids.shape[1]
        capacity = kv_buffers[0].shape[2]
        dtype = self.norm.weight.dtype  # not the embedding: a streamed network would read it
        windows = {self.cfg.layer_window(i) for i in range(len(self.layers))}
        if causal_chain:  # the kernel's own causal mask, its sliding window the local_window_size attribute
            biases = dict.fromkeys(windows)
            # the kernel's own positions, unless a flagged row reads the long factors' rows of the tables
            position_ids = None if long_rope is None else past_length.view(-1, 1) + torch.arange(tokens).view(1, -1)
        else:
            biases = {w: attention_bias(tree_mask, position_ids, past_length, capacity, w, dtype) for w in windows}
        rows = tokens
        if min_rows is not None:  # step padding: every row-wise kernel sees at least M rows
            rows = torch.sym_max(tokens, min_rows.shape[0])
            index, position_ids, biases = padded_rows(tokens, rows, past_length, position_ids, biases)
            input_ids = input_ids.index_select(1, index)
        x = self.embed_tokens(input_ids)
        attended = None
        if attention_pad:
            attended, position_ids, biases = padded_rows(
                rows, torch.sym_max(rows, attention_pad + 1), past_length, position_ids, biases
            )
        presents, inputs = [], {}
        pending = None  # the previous layer's MLP output, added to the residual by the next skip-norm
        for i, layer in enumerate(self.layers):
            if pending is None:
                h = layer.input_layernorm(x)
            else:
                h, x = skip_rms_norm(layer.input_layernorm, pending, x)
            if i in capture_layers:
                inputs[i] = x
            attn = layer.self_attn
            heads, k, v = group_query_attention(
                attn,
                attn.normed_qkv(attn.qkv_proj(h)),
                kv_buffers[2 * i],
                kv_buffers[2 * i + 1],
                past_length,
                self.rotary_positions(i, position_ids, long_rope),
                biases[self.cfg.layer_window(i)],
                *self.rotary(i),
                rows=attended,
                window=self.cfg.layer_window(i) if causal_chain else None,
            )
            presents += [k, v]
            h, x = skip_rms_norm(layer.mlp_norm, layer.attention_output(attn.o_proj(heads)), x)
            pending = layer.mlp_output(layer.mlp(h))
        hidden, x = skip_rms_norm(self.norm, pending, x)
        inputs[len(self.layers)] = x
        captured = [inputs[i] for i in capture_layers]
        if min_rows is not None:
            hidden, captured = hidden.narrow(1, 0, tokens), [c.narrow(1, 0, tokens) for c in captured]
        return hidden, presents, captured

    def forward(self, input_ids, position_ids, tree_mask, past_length, kv_cache, capture_layers=(), long_rope=None):
        x = self.embed_tokens(input_ids)
        ropes = {
            local: self.rope(position_ids, x.dtype, local, long_rope)
            for local in {self.local_rope(i) for i in range(len(self.layers))}
        }
        capacity = kv_cache.shape[4]
        masks = {None: self.attention_mask(tree_mask, past_length, capacity)}
        for window in {self.cfg.layer_window(i) for i in range(len(self.layers))} - {None}:
            masks[window] = self.attention_mask(tree_mask, past_length, capacity, position_ids, window)
        new_k, new_v, inputs = [], [], {}
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                inputs[i] = x
            mask = masks[self.cfg.layer_window(i)]
            x, k, v = layer(x, *ropes[self.local_rope(i)], mask, kv_cache[i, 0], kv_cache[i, 1])
            new_k.append(k)
            new_v.append(v)
        inputs[len(self.layers)] = x  # "input of layer L" = the last layer's output before the final norm
        new_kv = torch.stack([torch.stack(new_k), torch.stack(new_v)], dim=1)
        return self.norm(x), new_kv, [inputs[i] for i in capture_layers]
