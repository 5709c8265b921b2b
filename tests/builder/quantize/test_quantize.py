"""Weight-only int4/int8 engines: every speculative mode reproduces the `none` engine of the same --weights token for
token (both graphs), the portable int4 graph is TensorRT-clean blockwise DequantizeLinear, both graphs share the
int4 bytes, the build records how far the quantized graph is from the float network, and the lossy options say so."""

import dataclasses
import json

import numpy as np
import onnx
import pytest
from rich.console import Console

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.builder.export.trt_compat import lint_onnx_for_tensorrt
from specbuild.builder.export.weights_file import WEIGHTS_FILE
from specbuild.errors import SpecbuildError
from specbuild.inspect import describe, render
from specbuild.runtime import kernels
from specbuild.runtime.engine import Engine, SamplingParams
from tests.helpers import graph_nodes, quiet
from tests.plugins.eagle_fixtures import write_eagle3_head
from tests.plugins.medusa_helpers import toy_model, write_medusa_heads
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("quantize")

PROMPTS = [[1, 5, 9, 3, 7], [1, 4], [1, 11, 10, 6, 2, 8, 3]]
MODES = {
    "none": {},
    "medusa": dict(tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "eagle3": dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8),
}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    model = toy_model("llama_gqa_llama3rope", root / "hf", vocab=12, seed=4)
    write_medusa_heads(root / "medusa", "v2", model.config.hidden_size, 12, num_heads=3, seed=4)
    write_eagle3_head(root / "eagle3", model.config, draft_vocab=8, seed=4)
    heads = {m: root / m for m in ("medusa", "eagle3")}
    return convert_checkpoint(root / "hf", root / "ckpt", heads=heads, progress=False)


@pytest.fixture(scope="module")
def int4_engines(toy, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return {
        mode: build_engine(toy, root / mode, BuildOptions(speculative_mode=mode, weights="int4", **kw), log=quiet)
        for mode, kw in MODES.items()
    }


def _outputs(engine_dir, graph):
    engine = Engine(engine_dir, threads=1, graph=graph)
    results = [engine.generate(input_ids=ids, max_new_tokens=30) for ids in PROMPTS]
    return [r.output_ids for r in results], [n for r in results for n in r.accepted_per_step]


@full("three int4 engines with both graphs")
@pytest.mark.parametrize("graph", [ef.BACKEND_ONNXRUNTIME, ef.BACKEND_TENSORRT])
def test_int4_speculation_equals_the_int4_none_engine(int4_engines, graph):
    base, _ = _outputs(int4_engines["none"], graph)
    for mode in ("medusa", "eagle3"):
        outputs, steps = _outputs(int4_engines[mode], graph)
        assert outputs == base, (mode, graph)
        assert max(steps) > 1, mode  # drafts were accepted
    # the two graphs hold the same quantized weights: the same greedy output
    assert (
        base
        == _outputs(
            int4_engines["none"], ef.BACKEND_ONNXRUNTIME if graph != ef.BACKEND_ONNXRUNTIME else ef.BACKEND_TENSORRT
        )[0]
    )


@full("three int4 engines with both graphs")
def test_int4_portable_graph_is_tensorrt_clean_and_shares_the_bytes(int4_engines, toy, tmp_path):
    engine_dir = int4_engines["eagle3"]
    portable = onnx.load(str(engine_dir / ef.ENGINE_ONNX), load_external_data=False)
    assert lint_onnx_for_tensorrt(portable) == []
    dq = [n for n in portable.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(len(n.input) == 2 for n in dq)  # symmetric: no zero point, as TensorRT requires
    assert {o.version for o in portable.opset_import if o.domain in ("", "ai.onnx")} == {21}
    fused = onnx.load(str(engine_dir / ef.ENGINE_ORT_ONNX), load_external_data=False)
    assert "GatherBlockQuantized" in {n.op_type for n in fused.graph.node}
    manifest = Engine(engine_dir).manifest
    for graph in manifest["graphs"]:
        q = graph["quantization"]
        assert (q["bits"], q["block_size"], q["accuracy_level"]) == (4, 32, 1)
        assert 0 <= q["top1_agreement"] <= 1 and q["max_logit_error"] >= q["mean_logit_error"] >= 0
    fp32 = build_engine(toy, tmp_path / "fp32", BuildOptions(speculative_mode="eagle3", **MODES["eagle3"]), log=quiet)
    # int4 with both graphs: smaller than fp32 (the graphs share the int4 blocks instead of storing them twice)
    assert (engine_dir / WEIGHTS_FILE).stat().st_size < 0.6 * (fp32 / WEIGHTS_FILE).stat().st_size


@full("three int4 engines with both graphs")
def test_int4_keeps_heads_and_draft_layers_float(int4_engines):
    """quantize.mode_nodes decides it: the matmuls of the mode's own modules (Medusa's heads, EAGLE-3's draft layer,
    unrolled per depth) keep float weights in both graphs, and engine.yaml says so; every graph records its real
    opset (21: blockwise int4)."""
    for mode, at_least in (("medusa", 2), ("eagle3", 9)):  # 2 head blocks; a draft layer's 7 projections, fc, lm_head
        engine_dir = int4_engines[mode]
        manifest = Engine(engine_dir).manifest
        assert manifest["weights"]["mode_weights"] == "float32"
        for graph in manifest["graphs"]:
            model = onnx.load(str(engine_dir / graph["file"]), load_external_data=False)
            assert graph["opset"] == 21 == {o.domain: o.version for o in model.opset_import}[""]
            init = model.graph.initializer
            floats = {i.name for i in init if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2}
            float_matmuls = [
                n for n in graph_nodes(model.graph) if n.op_type in ("MatMul", "Gemm") and n.input[1] in floats
            ]
            assert len(float_matmuls) >= at_least, (mode, graph["file"])
            assert "DequantizeLinear" in {n.op_type for n in model.graph.node}  # the base network's matmuls are int4


@full("int8 weights (the fast tier builds int4 with int8 activations: tests/runtime/test_exactness.py)")
def test_int8_builds_the_onnxruntime_graph_and_stays_exact(toy, tmp_path):
    with pytest.raises(SpecbuildError, match="--weights int8 builds the onnxruntime graph only"):
        build_engine(toy, tmp_path / "x", BuildOptions(weights="int8"), log=quiet)
    ort_only = (ef.BACKEND_ONNXRUNTIME,)
    engines = {
        mode: build_engine(
            toy, tmp_path / mode, BuildOptions(speculative_mode=mode, weights="int8", backends=ort_only, **kw)
        )
        for mode, kw in MODES.items()
        if mode != "eagle3"
    }
    base, _ = _outputs(engines["none"], ef.BACKEND_ONNXRUNTIME)
    outputs, steps = _outputs(engines["medusa"], ef.BACKEND_ONNXRUNTIME)
    assert outputs == base and max(steps) > 1
    fused = onnx.load(str(engines["none"] / ef.ENGINE_ORT_ONNX), load_external_data=False)
    bits = {a.i for n in fused.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {8}


@full("int8-activation engines of several modes")
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_int8_activations_keep_chain_speculation_exact(toy, tmp_path, weights):
    """Level-4 MatMulNBits (int4, on specbuild's BlockInt4MatMul where the kernel library builds) and the integer
    GEMM (int8, builder/quantize/int8_gemm.py) are batch-invariant and attention is padded to >= 2 rows
    (ort_kernels), so a chain of drafts verifies each token bit for bit as the one-token step of the none engine built
    the same way. Branching trees put a node's keys in other cache columns: they are exact on specbuild's ordered
    attention (runtime/kernels), and without it refused unless allowed to run labelled lossy."""
    with pytest.raises(SpecbuildError, match="--int8-activations applies to --weights int4"):
        build_engine(toy, tmp_path / "x", BuildOptions(int8_activations=True), log=quiet)
    ort_only = (ef.BACKEND_ONNXRUNTIME,)
    options = dict(weights=weights, int8_activations=True, backends=ort_only)
    modes = {
        "none": {},
        "ngram": dict(num_draft_tokens=3),  # one candidate: chains
        "medusa": dict(tree=[[0], [0, 0], [0, 0, 0]]),  # a chain tree
        "eagle3": dict(eagle_top_k=1, eagle_depth=3, eagle_total_tokens=4),  # a dynamic tree of top-k 1: a chain
    }
    engines = {
        mode: build_engine(toy, tmp_path / mode, BuildOptions(speculative_mode=mode, **options, **kw), log=quiet)
        for mode, kw in modes.items()
    }
    base, _ = _outputs(engines["none"], ef.BACKEND_ONNXRUNTIME)
    for mode, engine_dir in engines.items():
        manifest = Engine(engine_dir).manifest
        assert manifest["lossless"] is True and manifest["lossy_reason"] is None, mode
        assert manifest["weights"]["activations"] == "int8"  # the benchmark's own-none reference needs it
        graph = manifest["graphs"][0]
        assert graph["quantization"]["accuracy_level"] == 4 and graph["attention_pad_rows"] == 1
        assert ("MatMulIntegerToFloat" in graph["quantization"]["kernel"]) == (weights == "int8")
        outputs, steps = _outputs(engine_dir, ef.BACKEND_ONNXRUNTIME)
        assert outputs == base, mode
        assert mode == "none" or max(steps) > 1, mode
    tree = build_engine(
        toy, tmp_path / "tree", BuildOptions(speculative_mode="medusa", **options, **MODES["medusa"]), log=quiet
    )
    manifest = Engine(tree, allow_lossy=True).manifest
    assert manifest["lossless"] is True and manifest["lossy_reason"] is None and manifest[ef.NEEDS_ORDERED_ATTENTION]
    # prompts ending where a call's tokens + the attention pad row cross the caches' first capacity (256): the KV
    # cache and EAGLE's draft KV state grow together (they are one dimension of the graph)
    long = [[1 + (i * 7 + j) % 11 for j in range(length)] for i, length in enumerate(range(250, 254))]
    long_base = [
        r.output_ids for r in (Engine(engines["none"], threads=1).generate(input_ids=p, max_new_tokens=8) for p in long)
    ]
    eagle = Engine(engines["eagle3"], threads=1)
    assert [eagle.generate(input_ids=p, max_new_tokens=8).output_ids for p in long] == long_base
    if kernels.library() is None:  # no compiler here: the stock attention cannot keep the promise
        with pytest.raises(SpecbuildError, match="exact on specbuild's ordered attention"):
            Engine(tree)
        return
    outputs, steps = _outputs(tree, ef.BACKEND_ONNXRUNTIME)
    assert outputs == base and max(steps) > 1  # branching trees, exact
    seeded = SamplingParams(temperature=0.8, seed=11)  # sampled: the none engine's draws, token for token
    none_engine, tree_engine = Engine(engines["none"], threads=1), Engine(tree, threads=1)
    for ids in PROMPTS:
        want = none_engine.generate(input_ids=ids, max_new_tokens=20, sampling=seeded).output_ids
        assert tree_engine.generate(input_ids=ids, max_new_tokens=20, sampling=seeded).output_ids == want
    with kernels.stock():
        assert Engine(tree, allow_lossy=True).lossless is False  # on the stock attention: labelled lossy
    eagle_tree = build_engine(
        toy, tmp_path / "eagle-tree", BuildOptions(speculative_mode="eagle3", **options, **MODES["eagle3"]), log=quiet
    )
    eagle = Engine(eagle_tree, threads=1)  # dynamic trees of top-k 3 across the caches' growth
    assert eagle.lossless and [eagle.generate(input_ids=p, max_new_tokens=8).output_ids for p in long] == long_base


def test_quantized_speculation_with_float_activations_gets_a_note(toy, tmp_path):
    """ONNX Runtime's level-1 MatMulNBits dequantizes for 2+ rows: the build says so where it matters (where
    specbuild's own int4 kernel, which takes those matmuls at load, cannot be built)."""
    from specbuild.builder.build import slow_quantized_verification
    from specbuild.builder.plan import resolve

    def slow(**kw):
        return slow_quantized_verification(resolve(toy, tmp_path / "x", BuildOptions(**kw)))

    with kernels.stock():  # where specbuild's int4 kernel is not available
        assert slow(speculative_mode="medusa", weights="int4", **MODES["medusa"])
    assert slow(speculative_mode="medusa", weights="int4", **MODES["medusa"]) == (kernels.library() is None)
    assert not slow(speculative_mode="medusa", weights="int4", int8_activations=True, backends=("onnxruntime",))
    assert not slow(weights="int4")  # no speculation
    assert not slow(speculative_mode="ngram", num_draft_tokens=3)  # float weights
    assert not slow(speculative_mode="ngram", weights="int4", backends=("tensorrt",))


@full("quantized heads: two engines per precision")
@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_head_weights_quantize_the_heads_alone_and_keep_the_output(toy, tmp_path, weights):
    """--head-weights: the mode's own matmuls (Medusa's heads, EAGLE-3's draft layer, fc and lm_head at every depth)
    become MatMulNBits with int8 activations in the onnxruntime graph, the target's stay as --weights built them,
    and the greedy output is the same-weights none engine's (drafts only propose)."""
    ort = (ef.BACKEND_ONNXRUNTIME,)
    base, _ = _outputs(build_engine(toy, tmp_path / "none", BuildOptions(weights=weights, backends=ort)), ort[0])
    for mode, heads, at_least in (("medusa", "int8", 2), ("eagle3", "int4", 9)):
        options = BuildOptions(speculative_mode=mode, weights=weights, backends=ort, head_weights=heads, **MODES[mode])
        engine_dir = build_engine(toy, tmp_path / mode, options, log=quiet)
        outputs, steps = _outputs(engine_dir, ort[0])
        assert outputs == base and max(steps) > 1, mode
        manifest = Engine(engine_dir).manifest
        assert manifest["weights"]["mode_weights"] == heads
        (graph,) = manifest["graphs"]
        q = graph["head_quantization"]
        assert (q["bits"], q["accuracy_level"]) == (ef.BLOCKWISE_BITS[heads], ef.ACCURACY_INT8)
        fused = onnx.load(str(engine_dir / ef.ENGINE_ORT_ONNX), load_external_data=False)
        blocks = [n for n in graph_nodes(fused.graph) if n.op_type == "MatMulNBits"]
        levels = [next(a.i for a in n.attribute if a.name == "accuracy_level") for n in blocks]
        assert len(blocks) == q["matmuls"] >= at_least and set(levels) == {ef.ACCURACY_INT8}
        floats = {i.name for i in fused.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2}
        target = [n for n in fused.graph.node if n.op_type == "MatMul" and n.input[1] in floats]
        assert bool(target) == (weights == "fp32")  # fp32: the target's matmuls stay float (int4: DequantizeLinear)
        console = Console(record=True, width=200)
        render(describe(engine_dir), console)
        assert f"({weights}, heads {heads}, shared KV" in console.export_text()  # specbuild inspect says so


def test_head_weights_are_refused_where_no_heads_or_graph_take_them(toy, tmp_path):
    cases = [
        (dict(head_weights="int8"), "applies to modes whose step graph drafts with heads"),
        (dict(speculative_mode="ngram", head_weights="int4"), "not --speculative-mode ngram"),
        (dict(speculative_mode="medusa", head_weights="fp16"), "--head-weights .fp16. is invalid"),
        (dict(speculative_mode="medusa", head_weights="int8", backends=(ef.BACKEND_TENSORRT,)), "add onnxruntime"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SpecbuildError, match=message):
            build_engine(toy, tmp_path / "x", BuildOptions(**kwargs), log=quiet)
        assert not (tmp_path / "x").exists()


@full("quantized heads: more engines")
def test_head_weights_go_into_the_portable_graph_where_it_serves_onnxruntime_alone(tmp_path):
    """A model the fused kernels cannot run (head_dim 24) gets the portable graph for onnxruntime: the heads are
    quantized there; with the tensorrt backend reading that graph too the build is refused before any work."""
    shape = "llama_tied_linear"
    model = toy_model(shape, tmp_path / "hf", vocab=12, seed=4)
    write_medusa_heads(tmp_path / "medusa", "v2", model.config.hidden_size, 12, num_heads=3, seed=4)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads={"medusa": tmp_path / "medusa"}, progress=False)
    tree = MODES["medusa"]["tree"]
    both = BuildOptions(speculative_mode="medusa", tree=tree, head_weights="int8")
    with pytest.raises(SpecbuildError, match="portable one .* --backends onnxruntime"):
        build_engine(ckpt, tmp_path / "x", both, log=quiet)
    assert not (tmp_path / "x").exists()
    ort = (ef.BACKEND_ONNXRUNTIME,)
    none = build_engine(ckpt, tmp_path / "none", BuildOptions(backends=ort), log=quiet)
    engine_dir = build_engine(ckpt, tmp_path / "medusa-h8", dataclasses.replace(both, backends=ort), log=quiet)
    (graph,) = Engine(engine_dir).manifest["graphs"]
    assert graph["file"] == ef.ENGINE_ONNX and graph["head_quantization"]["matmuls"] >= 2
    outputs, steps = _outputs(engine_dir, ort[0])
    assert outputs == _outputs(none, ort[0])[0] and max(steps) > 1


def _record_defaults(head_dir, **defaults):
    config_file = head_dir / "config.json"
    cfg = json.loads(config_file.read_text())
    cfg["specbuild_defaults"] = {**cfg.get("specbuild_defaults", {}), **defaults}
    config_file.write_text(json.dumps(cfg))


@full("recorded head weights: several engines")
def test_recorded_head_weights_are_the_build_default_and_float_opts_out(tmp_path):
    """A head's specbuild_defaults.head_weights (what its recipe's choose stage measured fastest) quantizes the heads
    of the graph serving ONNX Runtime alone when no --head-weights is given (the portable graph beside it stays
    float), `--head-weights float` keeps them float, and the output is the none engine's either way."""
    model = toy_model("llama_gqa_llama3rope", tmp_path / "hf", vocab=12, seed=4)
    write_medusa_heads(tmp_path / "medusa", "v2", model.config.hidden_size, 12, num_heads=3, seed=4)
    write_eagle3_head(tmp_path / "eagle3", model.config, draft_vocab=8, seed=4)
    _record_defaults(tmp_path / "medusa", head_weights="int4", tree=MODES["medusa"]["tree"])
    chain = dict(eagle_top_k=1, eagle_depth=3, eagle_total_tokens=4)  # exact with int8 activations
    _record_defaults(tmp_path / "eagle3", head_weights="int8", **MODES["eagle3"], by_weights={"int4": chain})
    heads = {m: tmp_path / m for m in ("medusa", "eagle3")}
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads=heads, progress=False)
    ort = ef.BACKEND_ONNXRUNTIME
    base, _ = _outputs(build_engine(ckpt, tmp_path / "none", BuildOptions(backends=(ort,)), log=quiet), ort)
    for mode, recorded, backends in (("medusa", "int4", ef.BACKENDS), ("eagle3", "int8", (ort,))):
        lines = []
        options = BuildOptions(speculative_mode=mode, backends=backends)
        engine_dir = build_engine(ckpt, tmp_path / f"e-{mode}", options, log=lines.append)
        assert any(line.startswith(f"heads: {recorded}: the heads' recorded choice") for line in lines), lines
        manifest = Engine(engine_dir).manifest
        assert manifest["weights"]["mode_weights"] == recorded
        quantized = {g["backend"]: g.get("head_quantization") for g in manifest["graphs"]}
        assert quantized.pop(ort)["bits"] == ef.BLOCKWISE_BITS[recorded] and not any(quantized.values())
        outputs, steps = _outputs(engine_dir, ort)
        assert outputs == base and max(steps) > 1, mode
    options = BuildOptions(speculative_mode="medusa", head_weights="float", backends=(ort,))
    manifest = Engine(float_dir := build_engine(ckpt, tmp_path / "e-float", options, log=quiet)).manifest
    assert manifest["weights"]["mode_weights"] == "float32" and not manifest["graphs"][0].get("head_quantization")
    assert _outputs(float_dir, ort)[0] == base
    # the recorded choice for --weights int4 (by_weights) replaces the tree: a chain, exact with int8 activations
    int4 = dict(weights="int4", int8_activations=True, backends=(ort,))
    base4, _ = _outputs(build_engine(ckpt, tmp_path / "none4", BuildOptions(**int4), log=quiet), ort)
    engine_dir = build_engine(ckpt, tmp_path / "e-chain", BuildOptions(speculative_mode="eagle3", **int4), log=quiet)
    manifest = Engine(engine_dir).manifest
    assert manifest["lossless"] is True and manifest["weights"]["mode_weights"] == "int8"
    assert {k: manifest["mode"]["expansion"][k] for k in ("top_k", "depth")} == {"top_k": 1, "depth": 3}
    outputs, steps = _outputs(engine_dir, ort)
    assert outputs == base4 and max(steps) > 1


@full("recorded head weights: several engines")
def test_recorded_head_weights_are_checked_and_skipped_where_no_graph_takes_them(tmp_path):
    """convert refuses a head_weights value it does not know (one line naming the field, nothing written); where
    the onnxruntime graph is the portable one the tensorrt backend reads too, the recorded choice is skipped (the
    build says so) instead of failing, while an explicit --head-weights is refused there."""
    model = toy_model("llama_tied_linear", tmp_path / "hf", vocab=12, seed=4)
    write_medusa_heads(tmp_path / "medusa", "v2", model.config.hidden_size, 12, num_heads=3, seed=4)
    _record_defaults(tmp_path / "medusa", head_weights="int3", tree=MODES["medusa"]["tree"])
    heads = {"medusa": tmp_path / "medusa"}
    with pytest.raises(SpecbuildError, match=r"config.json: specbuild_defaults.head_weights must be one of float, "):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads=heads, progress=False)
    assert not (tmp_path / "ckpt").exists()
    _record_defaults(tmp_path / "medusa", head_weights="int8", by_weights={"int3": {"head_weights": "int4"}})
    with pytest.raises(SpecbuildError, match=r"config.json: specbuild_defaults.by_weights must map weights \(fp32, "):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads=heads, progress=False)
    _record_defaults(tmp_path / "medusa", by_weights={"int4": {"head_weights": "fp8"}})
    with pytest.raises(SpecbuildError, match=r"specbuild_defaults.by_weights.int4.head_weights must be one of float"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads=heads, progress=False)
    assert not (tmp_path / "ckpt").exists()
    _record_defaults(tmp_path / "medusa", by_weights={})
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", heads=heads, progress=False)
    lines = []
    engine_dir = build_engine(ckpt, tmp_path / "both", BuildOptions(speculative_mode="medusa"), log=lines.append)
    assert any("recorded head_weights int8 skipped (the portable onnxruntime graph" in line for line in lines), lines
    assert Engine(engine_dir).manifest["weights"]["mode_weights"] == "float32"
    ort_only = BuildOptions(speculative_mode="medusa", backends=(ef.BACKEND_ONNXRUNTIME,))
    engine_dir = build_engine(ckpt, tmp_path / "ort", ort_only, log=quiet)
    assert Engine(engine_dir).manifest["graphs"][0]["head_quantization"]["bits"] == 8


@pytest.mark.parametrize("v,h,block", [(5000, 64, 32), (9000, 576, 32), (4097, 96, 16), (3, 32, 32)])
def test_the_table_quantizer_is_onnx_runtimes_bit_for_bit(v, h, block):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantizer

    from specbuild.builder.quantize.blockwise import quantize_table_rows

    table = (np.random.default_rng(v).standard_normal((v, h)) * 0.02).astype(np.float32)
    table[0, :block], table[1, :block], table[2, 5] = 0.0, 3.0, -7.0  # a zero block, a flat one, an outlier
    with np.errstate(invalid="ignore"):
        want = DefaultWeightOnlyQuantizer.quantize_ndarray(table, 1, block, True)[:2]
    got = quantize_table_rows(table, block)
    for a, b in zip(want, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
