"""--kv-cache int8 (builder/quantize/kv_int8.py): what the design takes from ONNX Runtime's int8 cache, the engine it
builds, and chain speculation and in-flight batching that stay exact against the none engine built the same way."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.quantize import kv_int8
from specbuild.errors import SpecbuildError
from specbuild.runtime import kernels as own_kernels
from specbuild.runtime import row_invariance
from specbuild.runtime.engine import Engine
from specbuild.runtime.sampling import SamplingParams
from tests.helpers import ORT_ONLY, quiet
from tests.plugins.eagle_fixtures import toy_eagle3_checkpoint
from tests.runtime.test_scheduler import PROMPTS, _alone, _batched
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("kv_int8")

HEADS, KV_HEADS, DIM, CAPACITY, SCALE = 2, 1, 16, 16, 0.1
ENGINES = "four toy engines (~1 min): the fast tier checks ONNX Runtime's int8 cache and the options"


def _quantize(x: np.ndarray, scale: float) -> np.ndarray:
    """x as the kernel should store it: round half to even, saturating to int8."""
    return np.clip(np.rint(x / np.float32(scale)), -kv_int8.QMAX - 1, kv_int8.QMAX).astype(np.int8)


def _attention_session():
    """One GroupQueryAttention with an int8 cache (per-tensor scales as inputs), no rotary, query_seqlens given."""
    width = (HEADS + 2 * KV_HEADS) * DIM
    info = helper.make_tensor_value_info
    inputs = [
        info("qkv", TP.FLOAT, [1, "S", width]), info("pk", TP.INT8, [1, KV_HEADS, CAPACITY, DIM]),
        info("pv", TP.INT8, [1, KV_HEADS, CAPACITY, DIM]), info("sk", TP.INT32, [1]), info("tot", TP.INT32, []),
        info("ks", TP.FLOAT, [1]), info("vs", TP.FLOAT, [1]), info("ql", TP.INT32, [1]),
    ]  # fmt: skip
    names = ["qkv", "", "", "pk", "pv", "sk", "tot", "", "", "", "", "", "ks", "vs", "", "", "ql"]
    node = helper.make_node(
        "GroupQueryAttention", names, ["out", "pk_out", "pv_out"], domain="com.microsoft", num_heads=HEADS,
        kv_num_heads=KV_HEADS, kv_cache_bit_width=8, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR",
    )  # fmt: skip
    outputs = [info("out", TP.FLOAT, None), info("pk_out", TP.INT8, None), info("pv_out", TP.INT8, None)]
    model = helper.make_model(
        helper.make_graph([node], "g", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _call(session, qkv, pk, pv, past):
    tokens = qkv.shape[1]
    scale = np.array([SCALE], np.float32)
    lengths = dict(sk=np.array([past + tokens - 1], np.int32), tot=np.array(CAPACITY, np.int32))
    feeds = dict(qkv=qkv, pk=pk, pv=pv, ks=scale, vs=scale, ql=np.array([tokens], np.int32), **lengths)
    return session.run(None, feeds)


def test_onnx_runtime_caches_new_tokens_in_8_bits_and_attends_over_the_cache():
    """What kv_int8 relies on: the kernel stores round-half-even, saturated keys and values, attends over them (the
    new tokens' too), and a token's bits do not depend on the other rows of its call."""
    session = _attention_session()
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((1, 3, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32)
    qkv[0, 0, HEADS * DIM : HEADS * DIM + 6] = [0.05, 0.15, 0.25, -0.15, 20.0, -20.0]  # half steps, saturation
    pk, pv = (rng.integers(-50, 50, (1, KV_HEADS, CAPACITY, DIM)).astype(np.int8) for _ in range(2))
    past = 4
    out, k, v = _call(session, qkv, pk, pv, past)
    keys, values = (qkv[0, :, HEADS * DIM : (HEADS + KV_HEADS) * DIM], qkv[0, :, (HEADS + KV_HEADS) * DIM :])
    assert np.array_equal(k[0, 0, past : past + 3], _quantize(keys, SCALE))
    assert np.array_equal(v[0, 0, past : past + 3], _quantize(values, SCALE))
    assert list(k[0, 0, past, :6]) == [0, 2, 2, -2, 127, -128]
    cached_k, cached_v = (c[0, 0, : past + 3].astype(np.float32) * SCALE for c in (k, v))
    for row in range(3):
        for head in range(HEADS):
            q = qkv[0, row, head * DIM : (head + 1) * DIM]
            scores = cached_k[: past + row + 1] @ q / np.sqrt(DIM)
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ cached_v[: past + row + 1]
            np.testing.assert_allclose(out[0, row, head * DIM : (head + 1) * DIM], want, atol=1e-5)
    first, k1, v1 = _call(session, qkv[:, :1], pk, pv, past)  # the same tokens as 1 + 2 calls
    rest, _, _ = _call(session, qkv[:, 1:], k1, v1, past + 1)
    assert np.array_equal(first[0, 0], out[0, 0]) and np.array_equal(rest[0], out[0, 1:])


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return toy_eagle3_checkpoint(tmp_path_factory.mktemp("kv_int8"), seed=4)


@pytest.fixture(scope="module")
def engines(toy, tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_int8_engines")
    int8 = dict(backends=ORT_ONLY, kv_cache=ef.KV_CACHE_INT8, max_seq_len=96)
    modes = {
        "float": dict(backends=ORT_ONLY, max_seq_len=96),
        "none": int8,
        "ngram": dict(speculative_mode="ngram", num_draft_tokens=3, **int8),  # one candidate: chains
        "eagle3": dict(speculative_mode="eagle3", eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8, **int8),
    }
    return {name: build_engine(toy, root / name, BuildOptions(**kw), log=quiet) for name, kw in modes.items()}


@full(ENGINES)
def test_the_engine_records_its_int8_cache_and_what_it_costs(engines):
    manifest = Engine(engines["none"]).manifest
    graph = manifest["graphs"][0]
    assert graph[ef.GRAPH_KV_CACHE_DTYPE] == "int8" and graph["attention_pad_rows"] == 1
    kv_inputs = [i for i in graph["io"]["inputs"] if i["name"].startswith(("past_key_", "past_value_"))]
    assert kv_inputs and all(i["dtype"] == "int8" for i in kv_inputs)
    quality = graph["kv_quantization"]
    assert quality["bits"] == 8 and quality["calibration_tokens"] == kv_int8.CALIBRATION_TOKENS
    assert 0.5 <= quality["top1_agreement"] <= 1 and quality["max_logit_error"] < 0.5
    assert manifest["lossless"] is True and manifest["lossless_condition"]
    model = onnx.load(str(engines["none"] / graph["file"]), load_external_data=False)
    assert ef.LOGITS not in {o.name for o in model.graph.output}  # the check's logits output dropped again
    float_graph = Engine(engines["float"]).manifest["graphs"][0]
    assert ef.GRAPH_KV_CACHE_DTYPE not in float_graph and "kv_quantization" not in float_graph


def _assert_reproduces(none, speculative) -> None:
    """`speculative` gives `none`'s greedy tokens with drafts accepted, and the same tokens alone and batched."""
    want = [none.generate(input_ids=ids, max_new_tokens=24).output_ids for ids in PROMPTS]
    results = [speculative.generate(input_ids=ids, max_new_tokens=24) for ids in PROMPTS]
    assert [r.output_ids for r in results] == want
    assert max(n for r in results for n in r.accepted_per_step) > 1
    alone = _alone(speculative, 0.0)
    _, handles = _batched(speculative, 0.0, prefill_chunk=5, speculation="always")
    assert [h.output_ids for h in handles] == alone


@full(ENGINES)
def test_chain_speculation_and_batching_reproduce_the_int8_none_engine(engines):
    """ngram drafts chains: its tokens are the none engine's of the same --kv-cache, alone and batched."""
    _assert_reproduces(Engine(engines["none"], threads=1), Engine(engines["ngram"], threads=1))


@full(ENGINES)
def test_branching_trees_over_an_int8_cache_with_float_activations_are_exact(engines):
    """Float activations over the int8 cache: a tree node's key must round to the bits decoding gives its token, so
    the float matmuls are padded to row invariance (the probe runs for the int8 cache too) and the attention is
    OrderedAttentionInt8; EAGLE-3's top-3 trees then reproduce the none engine, greedy and seeded-sampled, alone and
    batched. Without the kernel library such an engine is refused, or labelled lossy where allowed."""
    manifest = Engine(engines["eagle3"], allow_lossy=True).manifest
    assert manifest["lossless"] is True and manifest["lossy_reason"] is None
    assert manifest[ef.NEEDS_ORDERED_ATTENTION] is True and manifest["weights"]["activations"] == "float"
    none = Engine(engines["none"], threads=1)
    assert none.exactness.probe is not None  # float activations, int8 cache: probed, not taken on trust
    if own_kernels.library() is None:
        with pytest.raises(SpecbuildError, match="exact on specbuild's ordered attention"):
            Engine(engines["eagle3"])
        return
    tree = Engine(engines["eagle3"], threads=1)
    _assert_reproduces(none, tree)
    seeded = SamplingParams(temperature=0.8, seed=5)
    for ids in PROMPTS:
        want = none.generate(input_ids=ids, max_new_tokens=20, sampling=seeded).output_ids
        assert tree.generate(input_ids=ids, max_new_tokens=20, sampling=seeded).output_ids == want
    with own_kernels.stock():
        assert Engine(engines["eagle3"], allow_lossy=True).lossless is False  # the stock attention: labelled lossy


@full("two toy engines with int4 weights, int8 activations and the int8 cache")
def test_branching_trees_with_int8_activations_over_an_int8_cache_are_exact(toy, tmp_path):
    """With int8 activations the matmuls are row-invariant and OrderedAttentionInt8 (runtime/kernels) gives a tree
    node its decoded bits, so EAGLE-3's top-3 trees over the int8 cache reproduce the none engine, alone and
    batched."""
    common = dict(backends=ORT_ONLY, kv_cache=ef.KV_CACHE_INT8, weights="int4", int8_activations=True, max_seq_len=96)
    tree = dict(speculative_mode="eagle3", eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8)
    none_dir = build_engine(toy, tmp_path / "none", BuildOptions(**common), log=quiet)
    tree_dir = build_engine(toy, tmp_path / "tree", BuildOptions(**common, **tree), log=quiet)
    manifest = Engine(tree_dir, allow_lossy=True).manifest
    assert manifest["lossless"] is True and manifest[ef.NEEDS_ORDERED_ATTENTION] is True
    if own_kernels.library() is None:
        with pytest.raises(SpecbuildError, match="exact on specbuild's ordered attention"):
            Engine(tree_dir)
        return
    _assert_reproduces(Engine(none_dir, threads=1), Engine(tree_dir, threads=1))


@full(ENGINES)
def test_the_probe_checks_the_int8_cache_attention(engines):
    graph = Engine(engines["none"]).manifest["graphs"][0]
    model = onnx.load(str(engines["none"] / graph["file"]), load_external_data=False)
    kernels = row_invariance.probe_model(model, 1, 0).kernels
    attention = [name for name in kernels if name.startswith("GroupQueryAttention")]
    assert attention and all("int8 cache" in name and kernels[name] is not None for name in attention)


def test_an_int8_cache_needs_the_onnxruntime_graph_alone(toy, tmp_path):
    with pytest.raises(SpecbuildError, match="--kv-cache int8 .* pass --backends onnxruntime"):
        build_engine(toy, tmp_path / "a", BuildOptions(kv_cache="int8"), log=quiet)
    with pytest.raises(SpecbuildError, match="--kv-cache 'fp8' is invalid"):
        build_engine(toy, tmp_path / "b", BuildOptions(kv_cache="fp8", backends=ORT_ONLY), log=quiet)
