"""ONNX Runtime's fused CPU kernels in the step graph: each function emits a `com.microsoft` operator while the
graph is exported for the ONNX Runtime backend, and computes the same thing with plain torch ops otherwise (that
reference is what the export is validated against).

- `group_query_attention`: GroupQueryAttention with packed QKV, rotary embedding at explicit (tree) positions, an
  additive mask (tree + sliding window) and the KV cache shared between its past input and present output: the new
  tokens' keys and values are written in place at [past, past + T) of the layer's buffer. Per-step work is
  O(new tokens), no concatenation or transposition of the cache.
- `skip_rms_norm`: SkipSimplifiedLayerNormalization (residual add + RMSNorm in one kernel).

The operators' contracts (ONNX Runtime contrib ops, com.microsoft domain, version 1): with `query_seqlens` given,
`total_sequence_length` may be the cache capacity C and `attention_bias` [B,1,T,C] is indexed by absolute key
position; `seqlens_k` = past + T - 1. A graph whose new tokens always form a causal chain at positions
past..past+T-1 (plain decoding: prefill, then one token per step) passes neither `position_ids` nor `attention_bias`:
the kernel's own causal mask and positions are the same thing, without the ~25 mask nodes and the bias reads
(docs/benchmarks/design-measurements.md); a sliding window there is the kernel's `local_window_size` attribute.

Row padding. ONNX Runtime's CPU kernels may compute a lone row with other code than a row of a multi-row call
(MLAS's one-row kernels against its multi-row ones), so the same token's outputs differ in the last bits between a
one-token decode step and a call that verifies several tokens. With float activations that stays at rounding level
(~1e-6 relative); with int8 activations (MatMulNBits accuracy level 4) those bits flip activation roundings and
greedy output drifts, so an int8-activation speculative engine would not reproduce its own none engine. Which kernels
do it depends on the CPU (the table of kernels and CPUs measured: docs/benchmarks/design-measurements.md).

Two paddings, both copies of the call's last token after it (at positions past + T, ...; their outputs are dropped,
their keys/values land in scratch cache slots after the committed length, overwritten by the next call; the runtime
keeps those slots allocated):
- attention padding (`attention_pad`, built in: `attention_pad_rows` in engine.yaml): attention always attends at
  least pad + 1 = 2 rows. Calls of two or more tokens (prefill, trees, drafts) attend their rows as they are.
- step padding (the `min_rows` input, runtime-chosen): every row-wise kernel of the call -- the whole network and
  the lm_head -- sees at least M rows, M = the input's length. The runtime measures on the machine that runs the
  engine which M makes every kernel of the engine row-invariant (runtime/row_invariance.py): 1 where MatMulNBits is
  (no cost), 2 where it is not (AVX2: a one-token step pays for two rows).
The rows come from one Gather on an index made once per graph (`padded_rows`): cheaper than appending the copy in
every layer (Slice + Concat, and a pad row in every call). A right-padded call (`query_seqlens` < T) does not do: it
takes the one-row path.
"""

from __future__ import annotations

import torch

from specbuild.builder.network.layers import RMSNorm, apply_rope
from specbuild.errors import SpecbuildError

MSFT = "com.microsoft"


def exporting() -> bool:
    return torch.onnx.is_in_onnx_export()


def rotary_tables(inv_freq: torch.Tensor, scaling: float, positions: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, R/2] for positions 0..positions-1, computed like the network's own rope() (R: the rotary
    dims, the whole head unless partial rotary)."""
    freqs = torch.arange(positions, dtype=torch.float32).unsqueeze(-1) * inv_freq.float()
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def check_rotary_dims(rotary: int, head_dim: int) -> None:
    """GroupQueryAttention rotates the first `rotary` dims of a head only when rotary / 2 is a multiple of 8 (its
    cos/sin cache check); the whole head always. A SpecbuildError for a partial rotary it cannot run."""
    if rotary < head_dim and (rotary // 2) % 8:
        raise SpecbuildError(
            f"partial rotary over {rotary} of {head_dim} dims per head: ONNX Runtime's GroupQueryAttention rotates "
            "a partial head only when the rotary dims are a multiple of 16; build with --backends tensorrt"
        )


def attention_bias(tree_mask, position_ids, past_length, capacity: int, window: int | None, dtype):
    """Additive mask [B,1,T,C] over absolute key positions: 0 where query i may see key j, -inf elsewhere.

    Cache positions j < past are visible, new token k (at position past + k) where tree_mask allows; with a sliding
    window a key must also lie above position_ids[i] - window (cache slot j holds position j)."""
    b, t, _ = tree_mask.shape
    cols = torch.arange(capacity, device=tree_mask.device).view(1, 1, capacity)  # [1,1,C]
    past = past_length.view(b, 1, 1)
    in_cache = cols < past  # [B,1,C]
    new_index = cols - past  # node index of a column in [past, past + T)
    in_new = (new_index >= 0) & (new_index < t)
    gather = torch.where(in_new, new_index, torch.zeros_like(new_index)).expand(b, t, capacity)
    in_tree = tree_mask.gather(2, gather) & in_new  # [B,T,C]
    visible = in_cache | in_tree
    if window is not None:
        key_pos = torch.where(in_new, position_ids.gather(1, gather[:, 0]).unsqueeze(1), cols.expand(b, 1, capacity))
        visible = visible & (key_pos > (position_ids - window).unsqueeze(2))
    zero = torch.zeros((), dtype=dtype)
    return torch.where(visible, zero, torch.full((), float("-inf"), dtype=dtype)).unsqueeze(1)


def padded_rows(tokens, count, past_length, position_ids, biases: dict):
    """For a call of `tokens` rows padded to `count` >= tokens rows (see the module docstring): (rows,
    position_ids, biases). rows: index [count] of the rows, the tokens then copies of the last one; the pad rows sit
    at positions past + tokens, ... and see what the last token sees. Made once per graph and shared by the layers."""
    rows = torch.arange(count).clamp(max=tokens - 1)
    extra = count - tokens
    if position_ids is not None:
        after = past_length.view(-1, 1) + tokens + torch.arange(extra).view(1, extra)
        position_ids = torch.cat([position_ids, after], dim=1)
    biases = {w: None if b is None else b.index_select(2, rows) for w, b in biases.items()}
    return rows, position_ids, biases


def group_query_attention(attn, qkv, k_buf, v_buf, past_length, position_ids, bias, cos, sin, rows=None, window=None):
    """attn: the layer's network.Attention (head counts); qkv [B,T,(Hq+2Hkv)D]; k_buf/v_buf [B,Hkv,C,D].
    bias None: the T new tokens are a causal chain at positions past..past+T-1 (rotated there too when position_ids
    is None; position_ids are the rotary tables' rows, see LlamaNetwork.rotary_positions). rows: the attended
    rows of a padded call, from padded_rows (which also pads position_ids and bias); C >= past + len(rows). window:
    a causal chain's sliding window (bias None), the kernel's `local_window_size`: keys j > i - window, as
    transformers' sliding window (the sliding-window and architecture tests compare them).

    Returns (out [B,T,Hq*D] before o_proj, present_k, present_v): the buffers with the T new rotated keys and values
    written at [past, past + T) (and a pad row's after them)."""
    if rows is not None:
        tokens = qkv.shape[1]
        out, present_k, present_v = group_query_attention(
            attn, qkv.index_select(1, rows), k_buf, v_buf, past_length, position_ids, bias, cos, sin, window=window
        )
        return out.narrow(1, 0, tokens), present_k, present_v
    b, t, _ = qkv.shape
    capacity = k_buf.shape[2]
    seqlens_k = (past_length + (t - 1)).to(torch.int32)
    query_lens = torch.full((b,), t, dtype=torch.int32)
    total = torch.ones((), dtype=torch.int32) * capacity  # the capacity: an upper bound, as query_seqlens is given
    if exporting():
        out, present_k, present_v = torch.onnx.ops.symbolic_multi_out(
            f"{MSFT}::GroupQueryAttention",
            [qkv, None, None, k_buf, v_buf, seqlens_k, total, cos, sin, position_ids, bias] + [None] * 5 + [query_lens],
            dict(
                num_heads=attn.num_heads,
                kv_num_heads=attn.num_kv_heads,
                do_rotary=1,
                **attn.kernel_scale(),
                **({"local_window_size": int(window)} if window is not None else {}),
            ),
            dtypes=(qkv.dtype, k_buf.dtype, v_buf.dtype),
            shapes=((b, t, attn.num_heads * attn.head_dim), k_buf.shape, v_buf.shape),
            version=1,
        )
        return out, present_k, present_v
    return _gqa_reference(attn, qkv, k_buf, v_buf, past_length, position_ids, bias, cos, sin, window)


def _gqa_reference(attn, qkv, k_buf, v_buf, past_length, position_ids, bias, cos, sin, window=None):
    b, t, _ = qkv.shape
    if bias is None:  # a causal chain after the cache (rotated at position_ids where given: the long rows' offset)
        chain_ids = past_length.view(b, 1) + torch.arange(t).view(1, t)
        chain = torch.tril(torch.ones((b, t, t), dtype=torch.bool))
        bias = attention_bias(chain, chain_ids, past_length, k_buf.shape[2], window, qkv.dtype)
        position_ids = chain_ids if position_ids is None else position_ids
    d, hq, hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q, k, v = torch.split(qkv, [hq * d, hkv * d, hkv * d], dim=-1)
    q = q.view(b, t, hq, d).transpose(1, 2)
    k = k.view(b, t, hkv, d).transpose(1, 2)
    v = v.view(b, t, hkv, d).transpose(1, 2)
    c = torch.cat([cos[position_ids], cos[position_ids]], dim=-1).unsqueeze(1).to(q.dtype)  # [B,1,T,D]
    s = torch.cat([sin[position_ids], sin[position_ids]], dim=-1).unsqueeze(1).to(q.dtype)
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    present_k, present_v = k_buf.clone(), v_buf.clone()
    outs = []
    for row in range(b):  # each sequence writes at its own length
        past = int(past_length[row])
        present_k[row, :, past : past + t] = k[row]
        present_v[row, :, past : past + t] = v[row]
        mask = bias[row : row + 1, :, :, : past + t] == 0  # [1,1,T,P+T]
        keys, values = [present_k[row : row + 1, :, : past + t]], [present_v[row : row + 1, :, : past + t]]
        outs.append(attn.attend_heads(q[row : row + 1], keys, values, mask.unsqueeze(1)))
    return torch.cat(outs, dim=0), present_k, present_v


def skip_rms_norm(norm: RMSNorm, x, skip):
    """(norm(x + skip), x + skip) -- one SkipSimplifiedLayerNormalization kernel in the ONNX Runtime graph."""
    if exporting():
        out, _, _, total = torch.onnx.ops.symbolic_multi_out(
            f"{MSFT}::SkipSimplifiedLayerNormalization",
            [x, skip, norm.weight],
            dict(epsilon=float(norm.eps)),
            dtypes=(x.dtype, torch.float32, torch.float32, x.dtype),
            shapes=(x.shape, (*x.shape[:-1], 1), (*x.shape[:-1], 1), x.shape),
            version=1,
        )
        return out, total
    total = x + skip
    return norm(total), total
