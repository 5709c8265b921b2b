"""Attention padding (ort_kernels): ONNX Runtime's GroupQueryAttention sums a lone query row differently from rows
of a multi-row call, so a one-token step and a tree verifying the same token differ in the last bits -- enough to
flip int8 activation roundings. Padded to two rows (a copy of the token after it), a one-token call gives what a
longer causal call gives for that token: this is what keeps --int8-activations speculation exact."""

import numpy as np
import onnx.helper as oh
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from specbuild.builder.network.llama import Attention
from specbuild.builder.network.ort_kernels import _gqa_reference, group_query_attention, padded_rows

HEADS, KV_HEADS, HEAD_DIM, CAPACITY, PAST = 9, 3, 64, 64, 40
WIDTH = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def gqa_session(specbuild_kernels: bool = False):
    """call(qkv, pad): the GroupQueryAttention node the fused graph emits for a causal chain (no bias, no position
    ids) on qkv [1,T,W] after PAST cached positions (specbuild_kernels: on runtime/kernels' OrderedAttention, as an
    engine with int8 activations runs it)."""
    inputs = ["qkv", "", "", "past_k", "past_v", "seqlens_k", "total", "cos", "sin", "", ""] + [""] * 5 + ["q_lens"]
    node = oh.make_node(
        "GroupQueryAttention", inputs, ["out", "present_k", "present_v"], domain="com.microsoft",
        num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1,
    )  # fmt: skip
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    graph = oh.make_graph(
        [node],
        "gqa",
        [oh.make_tensor_value_info("qkv", f, [1, "T", WIDTH]),
         oh.make_tensor_value_info("past_k", f, [1, KV_HEADS, CAPACITY, HEAD_DIM]),
         oh.make_tensor_value_info("past_v", f, [1, KV_HEADS, CAPACITY, HEAD_DIM]),
         oh.make_tensor_value_info("seqlens_k", i32, [1]), oh.make_tensor_value_info("total", i32, []),
         oh.make_tensor_value_info("cos", f, [CAPACITY, HEAD_DIM // 2]),
         oh.make_tensor_value_info("sin", f, [CAPACITY, HEAD_DIM // 2]),
         oh.make_tensor_value_info("q_lens", i32, [1])],
        [oh.make_tensor_value_info(n, f, None) for n in ("out", "present_k", "present_v")],
    )  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18), oh.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    if specbuild_kernels:
        from specbuild.runtime import kernels
        from specbuild.runtime.kernels.rewrite import use_kernels

        assert use_kernels(model) == 1
        kernels.register(options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((2, 1, KV_HEADS, CAPACITY, HEAD_DIM)).astype(np.float32)
    angles = rng.random((CAPACITY, HEAD_DIM // 2)).astype(np.float32)

    def call(qkv: np.ndarray, pad: int) -> np.ndarray:
        """Attention outputs of the T rows of qkv [1,T,W] after PAST cached positions (pad: rows added after)."""
        t = qkv.shape[1]
        rows = np.concatenate([qkv] + [qkv[:, -1:]] * pad, axis=1)
        feeds = {
            "qkv": rows, "past_k": cache[0].copy(), "past_v": cache[1].copy(),
            "seqlens_k": np.array([PAST + t + pad - 1], np.int32), "total": np.array(CAPACITY, np.int32),
            "cos": np.cos(angles), "sin": np.sin(angles), "q_lens": np.array([t + pad], np.int32),
        }  # fmt: skip
        return session.run(["out"], feeds)[0][:, :t]

    return call


@pytest.fixture(scope="module")
def gqa():
    return gqa_session(), np.random.default_rng(1)


def test_a_padded_one_token_call_equals_the_rows_of_longer_calls(gqa):
    call, rng = gqa
    chain = rng.standard_normal((1, 5, WIDTH)).astype(np.float32)
    longer = call(chain, pad=1)
    assert np.array_equal(call(chain[:, :3], pad=0), longer[:, :3])  # T >= 2 rows agree whatever T is
    assert np.array_equal(call(chain[:, :1], pad=1), longer[:, :1])  # the one-token step, padded: bit for bit


def test_the_torch_reference_writes_the_pad_row_like_the_kernel(gqa):
    """_gqa_reference (what the export is validated against) attends and writes a padded call the same way: a
    one-token call attends a copy of its token after it, whose key lands in the next slot."""
    attn = Attention(HEADS * HEAD_DIM, HEADS * HEAD_DIM, HEADS, KV_HEADS, HEAD_DIM, bias=False)
    qkv = torch.randn(1, 1, WIDTH)
    k_buf, v_buf = torch.zeros(1, KV_HEADS, 16, HEAD_DIM), torch.zeros(1, KV_HEADS, 16, HEAD_DIM)
    cos, sin = torch.ones(16, HEAD_DIM // 2), torch.zeros(16, HEAD_DIM // 2)
    past = torch.tensor([4])
    rows, _, _ = padded_rows(1, 2, past, None, {None: None})
    assert rows.tolist() == [0, 0]
    out, k, _ = group_query_attention(attn, qkv, k_buf, v_buf, past, None, None, cos, sin, rows=rows)
    plain, k_plain, _ = _gqa_reference(attn, qkv, k_buf, v_buf, past, None, None, cos, sin)
    assert out.shape == (1, 1, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close(k[:, :, :5], k_plain[:, :, :5])
    torch.testing.assert_close(k[:, :, 5], k_plain[:, :, 4])  # the pad row: the token's key again
    assert not k[:, :, 6:].any()


def test_calls_of_several_tokens_are_not_padded():
    """Prefill, trees and drafts already take the multi-row path: their rows, positions and masks stay as they are;
    a one-token call's pad row sits after it and sees what it sees."""
    past = torch.tensor([7])
    positions = torch.tensor([[7, 8, 8]])
    bias = torch.randn(1, 1, 3, 16)
    rows, padded_positions, biases = padded_rows(3, 3, past, positions, {None: bias, 4: None})
    assert rows.tolist() == [0, 1, 2] and torch.equal(padded_positions, positions)
    assert torch.equal(biases[None], bias) and biases[4] is None
    rows, padded_positions, biases = padded_rows(1, 2, past, positions[:, :1], {None: bias[:, :, :1]})
    assert rows.tolist() == [0, 0] and padded_positions.tolist() == [[7, 8]]
    assert torch.equal(biases[None], bias[:, :, [0, 0]])
