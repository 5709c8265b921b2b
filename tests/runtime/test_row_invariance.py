"""The row-invariance probe: what it finds for each kernel configuration agrees with a direct measurement of that
kernel on this machine (whichever CPU runs the test), its verdict is kept per graph, CPU, ONNX Runtime version and
thread count, and the step padding follows from the kernels' verdicts."""

from __future__ import annotations

import numpy as np
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from specbuild.runtime import kernels
from specbuild.runtime import row_invariance as ri
from specbuild.runtime.backends.onnxruntime import session_options
from specbuild.runtime.kernels.rewrite import use_kernels

SHAPES = [(576, 960, 32), (1536, 576, 32), (64, 96, 16)]  # SmolLM2's q/k/v and down projections; a tiny one
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def engine_like_graph(path=None):
    """A graph holding the fused engine graph's kernel patterns: block-quantized MatMuls (DequantizeLinear of int4
    blocks, as `build --weights int4` writes them), GroupQueryAttention and SkipSimplifiedLayerNormalization."""
    nodes, inits, inputs = [], [], [oh.make_tensor_value_info("past_key_0", TensorProto.FLOAT, [1, KV_HEADS, "C", 64])]
    for i, (k, n, block) in enumerate(SHAPES):
        inits.append(oh.make_tensor(f"q{i}", TensorProto.INT4, [k, n], bytes(k * n // 2), raw=True))
        inits.append(numpy_helper.from_array(np.ones((k // block, n), np.float32), f"s{i}"))
        nodes.append(oh.make_node("DequantizeLinear", [f"q{i}", f"s{i}"], [f"w{i}"], axis=0, block_size=block))
        nodes.append(oh.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"]))
    gqa_inputs = ["qkv", "", "", "past_key_0", "past_value_0", "sk", "tot", "cos", "sin", "", ""] + [""] * 5 + ["ql"]
    nodes.append(oh.make_node("GroupQueryAttention", gqa_inputs, ["o", "pk", "pv"], domain="com.microsoft",
                              num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1))  # fmt: skip
    inits.append(numpy_helper.from_array(np.ones(576, np.float32), "gamma"))
    nodes.append(oh.make_node("SkipSimplifiedLayerNormalization", ["a", "b", "gamma"], ["n"], domain="com.microsoft",
                              epsilon=1e-5))  # fmt: skip
    graph = oh.make_graph(nodes, "engine_like", inputs, [], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid("com.microsoft", 1)])


def direct_rows_from(outputs: dict[int, np.ndarray]) -> int | None:
    """Expected verdict from a kernel's outputs for calls of 1..4 rows (row r of each call compared)."""
    longest = outputs[4]
    agree = {rows: np.array_equal(outputs[rows], longest[:, :rows]) for rows in (1, 2, 3)}
    if all(agree.values()):
        return 1
    return 2 if agree[2] and agree[3] else None


def matmul_direct(k: int, n: int, block: int) -> int | None:
    """One block-quantized MatMul measured on its own, with other random weights than the probe's."""
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, k * n // 2, dtype=np.uint8).tobytes()
    q = oh.make_tensor("q", TensorProto.INT4, [k, n], blocks, raw=True)
    scales = numpy_helper.from_array(rng.uniform(0.01, 0.02, (k // block, n)).astype(np.float32), "s")
    nodes = [oh.make_node("DequantizeLinear", ["q", "s"], ["w"], axis=0, block_size=block),
             oh.make_node("MatMul", ["x", "w"], ["y"])]  # fmt: skip
    graph = oh.make_graph(nodes, "mm", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)], [q, scales])  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    options = session_options(1, 4)
    if kernels.library() is not None and use_kernels(model):  # as the probe and the engines: specbuild's kernel
        kernels.register(options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 4, k)).astype(np.float32)
    return direct_rows_from({rows: session.run(None, {"x": x[:, :rows]})[0] for rows in (1, 2, 3, 4)})


@pytest.fixture(scope="module")
def verdict():
    return ri.probe_model(engine_like_graph(), threads=1, accuracy_level=4)


def test_the_probe_finds_every_kernel_configuration(verdict):
    names = set(verdict.kernels)
    for k, n, block in SHAPES:
        assert f"MatMulNBits {k}x{n} block {block}" in names
    assert f"GroupQueryAttention {HEADS}/{KV_HEADS} heads x {HEAD_DIM}" in names
    assert "SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization / SiLU 576" in names
    assert verdict.cpu == ri.cpu_description() and verdict.seconds > 0


@pytest.mark.parametrize("shape", SHAPES)
def test_the_probe_agrees_with_a_direct_measurement_of_the_kernel(verdict, shape):
    """On an AVX2-only CPU MatMulNBits at block 32 computes a lone row with other code (rows_from 2), at block 16 it
    does not (1); on AVX-512 neither does. Whatever this CPU does, the probe must say the same."""
    k, n, block = shape
    assert verdict.kernels[f"MatMulNBits {k}x{n} block {block}"] == matmul_direct(k, n, block)


def test_the_probe_agrees_with_a_direct_measurement_of_attention(verdict):
    from tests.builder.network.test_ort_kernels import CAPACITY, PAST, WIDTH, gqa_session

    call = gqa_session(specbuild_kernels=kernels.library() is not None)  # what the probe measures at level 4
    chain = np.random.default_rng(3).standard_normal((1, 4, WIDTH)).astype(np.float32)
    outputs = {rows: call(chain[:, :rows], pad=0) for rows in (1, 2, 3, 4)}
    assert CAPACITY > PAST + 4
    assert verdict.kernels[f"GroupQueryAttention {HEADS}/{KV_HEADS} heads x {HEAD_DIM}"] == direct_rows_from(outputs)


def test_norms_and_silu_are_row_invariant(verdict):
    assert verdict.kernels["SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization / SiLU 576"] == 1


def fake_calls(rows_from: int | None, width: int = 4) -> dict[int, dict]:
    """Outputs of calls of 1..MAX_PROBE_ROWS rows of a kernel whose rows agree from `rows_from` rows on (None: no
    two call sizes agree)."""
    base = np.arange(ri.MAX_PROBE_ROWS * width, dtype=np.float32).reshape(1, ri.MAX_PROBE_ROWS, width)
    calls = {}
    for rows in range(1, ri.MAX_PROBE_ROWS + 1):
        out = base[:, :rows].copy()
        if rows_from is None or rows < rows_from:
            out += np.float32(rows * 1e-3)  # other bits
        calls[rows] = {"y": out}
    return calls


@pytest.mark.parametrize("rows_from", [1, 2, 3, None])
def test_rows_from(rows_from):
    kernel = ri.Kernel("k", [], [], [], {"y": 1}, lambda rows, past: {})
    assert ri._rows_from(kernel, fake_calls(rows_from), past=0) == rows_from


def test_step_padding_follows_from_the_kernels():
    mm, gqa = "MatMulNBits 576x960 block 32", "GroupQueryAttention 9/3 heads x 64"
    # AVX-512 (measured): attention needs 2 rows (padded in the graph already), MatMulNBits none
    assert ri.engine_min_rows({mm: 1, gqa: 2}, attention_pad=1, max_min_rows=2) == 1
    # AVX2 (measured): MatMulNBits needs 2 rows -> every call padded to 2
    assert ri.engine_min_rows({mm: 2, gqa: 2}, attention_pad=1, max_min_rows=2) == 2
    # a graph built before step padding (max 1) or a kernel needing more than it can pad: no exact path
    assert ri.engine_min_rows({mm: 2, gqa: 2}, attention_pad=1, max_min_rows=1) is None
    assert ri.blocking({mm: 2, gqa: 2}, attention_pad=1, max_min_rows=1) == [mm]
    assert ri.engine_min_rows({mm: 3, gqa: 2}, attention_pad=1, max_min_rows=2) is None
    assert ri.engine_min_rows({mm: None, gqa: 1}, attention_pad=1, max_min_rows=2) is None
    assert ri.engine_min_rows({mm: 1, gqa: 3}, attention_pad=1, max_min_rows=2) is None


def test_the_verdict_is_kept_per_graph_cpu_and_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", str(tmp_path / "cache"))
    graph = tmp_path / "g.onnx"
    import onnx

    onnx.save(engine_like_graph(), str(graph))
    probes = []
    real = ri.probe_model
    monkeypatch.setattr(ri, "probe_model", lambda *a, **k: probes.append(a[1:]) or real(*a, **k))
    first = ri.check_graph(graph, "a" * 64, 1, 4, attention_pad=1, max_min_rows=2)
    again = ri.check_graph(graph, "a" * 64, 1, 4, attention_pad=1, max_min_rows=2)
    assert not first.cached and again.cached and again.kernels == first.kernels and again.min_rows == first.min_rows
    assert len(probes) == 1
    ri.check_graph(graph, "a" * 64, 2, 4, attention_pad=1, max_min_rows=2)  # other thread count: measured again
    ri.check_graph(graph, "b" * 64, 1, 4, attention_pad=1, max_min_rows=2)  # another graph file
    longer = ri.check_graph(graph, "a" * 64, 1, 4, attention_pad=1, max_min_rows=2, max_rows=21)  # longer calls
    assert probes == [(1, 4, 16), (2, 4, 16), (1, 4, 16), (1, 4, 21)]
    assert longer.kernels == first.kernels  # same verdicts, measured on calls of up to 21 rows
    monkeypatch.setenv("SPECBUILD_CACHE_DIR", "off")
    assert not ri.check_graph(graph, "a" * 64, 1, 4, attention_pad=1, max_min_rows=2).cached
