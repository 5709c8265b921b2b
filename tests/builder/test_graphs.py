"""One build, one graph per backend: the ONNX Runtime graph (fused kernels, KV cache written in place) and the
portable graph TensorRT parses give the same greedy ids as transformers in every mode; they share one weights file;
models the fused kernels cannot run get the portable graph for ONNX Runtime too."""

import numpy as np
import onnx
import pytest

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.convert import convert_checkpoint
from specbuild.builder.export import weights_ahead
from specbuild.builder.export.trt_compat import lint_onnx_for_tensorrt
from specbuild.builder.export.weights_file import WEIGHTS_FILE
from specbuild.runtime.engine import Engine
from tests.helpers import assert_drafting_behind_an_if, hf_greedy, quiet
from tests.plugins.eagle_fixtures import write_eagle1_head, write_eagle3_head
from tests.plugins.medusa_helpers import toy_model, write_medusa_heads
from tests.plugins.redrafter_fixtures import write_redrafter
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("graphs")

PROMPTS = [[1, 5, 9, 3, 7], [1, 11, 10, 6, 2, 8, 3]]
MODES = {
    "none": {},
    "medusa": dict(tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "eagle": dict(tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
    "eagle3": dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8),
    "redrafter": dict(redrafter_num_beams=3, redrafter_draft_len_per_beam=3),
}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(HF model, checkpoint with Medusa, EAGLE-1, EAGLE-3 heads and a ReDrafter drafter) of a 12-token toy (drafts
    often accepted)."""
    root = tmp_path_factory.mktemp("graphs")
    model = toy_model("llama_gqa_llama3rope", root / "hf", vocab=12, seed=2)
    write_medusa_heads(root / "medusa", "v2", model.config.hidden_size, 12, num_heads=3, seed=2)
    write_eagle1_head(root / "eagle", model.config, seed=2)
    write_eagle3_head(root / "eagle3", model.config, draft_vocab=8, seed=2)
    write_redrafter(root / "redrafter", model.config.hidden_size, 12, exit_dim=48, seed=2)
    heads = {m: root / m for m in ("medusa", "eagle", "eagle3", "redrafter")}
    return model, convert_checkpoint(root / "hf", root / "ckpt", heads=heads, progress=False)


@full("both graphs of every mode (the fast tier runs none's: tests/runtime/test_engine.py)")
@pytest.mark.parametrize("mode", list(MODES))
def test_both_graphs_equal_transformers(toy, tmp_path, monkeypatch, mode):
    model, ckpt = toy
    # weights written while a graph was traced in a layout it did not take (builder/export/weights_ahead.py)
    unclaimed = []
    finish = weights_ahead.WeightsAhead.finish
    monkeypatch.setattr(
        weights_ahead.WeightsAhead, "finish", lambda self, *a: (finish(self, *a), unclaimed.extend(self.unclaimed()))
    )
    engine_dir = build_engine(ckpt, tmp_path / "engine", BuildOptions(speculative_mode=mode, **MODES[mode]), log=quiet)
    assert unclaimed == []
    manifest = Engine(engine_dir).manifest
    layouts = {g["backend"]: (g["file"], g["kv_cache"]) for g in manifest["graphs"]}
    assert layouts == {
        ef.BACKEND_ONNXRUNTIME: (ef.ENGINE_ORT_ONNX, ef.KV_SHARED),
        ef.BACKEND_TENSORRT: (ef.ENGINE_ONNX, ef.KV_STACKED),
    }
    fused = onnx.load(str(engine_dir / ef.ENGINE_ORT_ONNX), load_external_data=False)
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= {n.op_type for n in fused.graph.node}
    for node in fused.graph.node:
        if node.op_type == "GroupQueryAttention":  # position_ids (9) and attention_bias (10): only trees need them
            assert all(node.input[9:11]) == (mode != "none"), node.input
        if node.op_type == "SkipSimplifiedLayerNormalization":  # nothing reads the mean / inverse std
            assert list(node.output[1:3]) == ["", ""]
    portable = onnx.load(str(engine_dir / ef.ENGINE_ONNX), load_external_data=False)
    assert lint_onnx_for_tensorrt(portable) == []
    if mode in ("eagle", "eagle3", "medusa", "redrafter"):  # engine-drafted: plain calls skip the drafting
        for name in (ef.ENGINE_ORT_ONNX, ef.ENGINE_ONNX):
            assert_drafting_behind_an_if(engine_dir / name)
    steps = []
    for graph in (ef.BACKEND_ONNXRUNTIME, ef.BACKEND_TENSORRT):  # the portable graph through ONNX Runtime
        engine = Engine(engine_dir, threads=1, graph=graph)
        for ids in PROMPTS:
            result = engine.generate(input_ids=ids, max_new_tokens=30)
            assert result.output_ids == hf_greedy(model, ids, 30), (graph, ids)
            steps += result.accepted_per_step
    assert mode == "none" or max(steps) > 1  # drafts were accepted: multi-token commits of the in-place cache


@full("two more n-gram engines (graph structure)")
def test_chain_drafts_attend_with_the_kernels_causal_mask(toy, tmp_path):
    """Prompt lookup with one candidate verifies chains at consecutive positions: its ONNX Runtime graph takes the
    attention kernel's own causal mask and positions like plain decoding (no mask nodes, no bias reads); with two
    candidates the calls are trees and carry positions and a bias. Both reproduce transformers."""
    model, ckpt = toy
    ort_only = (ef.BACKEND_ONNXRUNTIME,)
    for candidates, tree_inputs in ((1, False), (2, True)):
        options = BuildOptions(
            speculative_mode="ngram", num_draft_tokens=3, ngram_candidates=candidates, backends=ort_only
        )
        engine_dir = build_engine(ckpt, tmp_path / f"c{candidates}", options, log=quiet)
        fused = onnx.load(str(engine_dir / ef.ENGINE_ORT_ONNX), load_external_data=False)
        gqa = [n for n in fused.graph.node if n.op_type == "GroupQueryAttention"]
        assert gqa and all(all(n.input[9:11]) == tree_inputs for n in gqa), candidates
        engine = Engine(engine_dir, threads=1)
        steps = []
        for ids in PROMPTS:
            result = engine.generate(input_ids=ids, max_new_tokens=30)
            assert result.output_ids == hf_greedy(model, ids, 30), (candidates, ids)
            steps += result.accepted_per_step
        assert max(steps) > 1, candidates


@full("two more engines (weight sharing)")
def test_graphs_share_one_weights_file(toy, tmp_path):
    _, ckpt = toy
    both = build_engine(ckpt, tmp_path / "both", BuildOptions(), log=quiet)
    one = build_engine(ckpt, tmp_path / "one", BuildOptions(backends=(ef.BACKEND_ONNXRUNTIME,)), log=quiet)
    assert sorted(p.name for p in both.iterdir() if p.suffix in (".data", ".bin")) == [WEIGHTS_FILE]
    # the second graph adds little: every weight but the rotary tables and graph-specific constants is shared
    assert (both / WEIGHTS_FILE).stat().st_size < 1.2 * (one / WEIGHTS_FILE).stat().st_size
    assert [g["backend"] for g in Engine(one).manifest["graphs"]] == [ef.BACKEND_ONNXRUNTIME]


@full("another engine (the fast tier's sliding-window model, head_dim 8, runs the portable graph too)")
def test_fused_kernels_need_head_dim_multiple_of_16(tmp_path):
    """head_dim 24: ONNX Runtime's GroupQueryAttention cannot run it, so ONNX Runtime gets the portable graph."""
    model = toy_model("llama_tied_linear", tmp_path / "hf", vocab=12)
    ckpt = convert_checkpoint(tmp_path / "hf", tmp_path / "ckpt", progress=False)
    engine_dir = build_engine(ckpt, tmp_path / "engine", BuildOptions(), log=quiet)
    engine = Engine(engine_dir, threads=1)
    assert (engine.graph["file"], engine.graph["kv_cache"]) == (ef.ENGINE_ONNX, ef.KV_STACKED)
    assert not (engine_dir / ef.ENGINE_ORT_ONNX).exists()
    assert engine.generate(input_ids=PROMPTS[0], max_new_tokens=20).output_ids == hf_greedy(model, PROMPTS[0], 20)


@full("a Medusa engine with both graphs")
def test_kv_buffer_is_written_in_place_and_compacted(toy, tmp_path):
    """After generation, the fused graph's in-place cache (drafts written at the end, accepted nodes moved down)
    holds the same keys and values, position by position, as the portable graph's appended cache."""
    _, ckpt = toy
    options = BuildOptions(speculative_mode="medusa", **MODES["medusa"])
    engine_dir = build_engine(ckpt, tmp_path / "engine", options, log=quiet)
    caches = {}
    for graph in (ef.BACKEND_ONNXRUNTIME, ef.BACKEND_TENSORRT):
        engine = Engine(engine_dir, threads=1, graph=graph)
        batch = engine.scheduler.batch
        real_remove = batch.remove
        # keep the cache as it is when the request leaves the batch
        batch.remove = lambda seq, batch=batch, graph=graph, real=real_remove: (
            caches.setdefault(graph, (batch.kv.lengths[0], batch.kv.feeds())),
            real(seq),
        )
        result = engine.generate(input_ids=PROMPTS[1], max_new_tokens=20)
        assert max(result.accepted_per_step) > 1
    (n_shared, shared), (n_stacked, stacked) = caches[ef.BACKEND_ONNXRUNTIME], caches[ef.BACKEND_TENSORRT]
    assert n_shared == n_stacked == len(PROMPTS[1]) + len(result.output_ids) - 1
    n = n_shared
    stacked = np.asarray(stacked[ef.KV_CACHE])  # [L,2,1,Hkv,C,D]
    for i in range(stacked.shape[0]):
        for j, name in enumerate((ef.PAST_KEY, ef.PAST_VALUE)):
            view = shared[name.format(i)]
            view = getattr(view, "array", view)  # a backend-bound buffer
            assert np.abs(view[..., :n, :] - stacked[i, j, ..., :n, :]).max() < 1e-4


@full("engines of their own (the weights' layout at each precision)")
@pytest.mark.parametrize("weights,mode", [("fp32", "medusa"), ("int4", "none")])
def test_tied_embeddings_are_stored_once_in_a_float_graph(tiny_hf_models, tmp_path, weights, mode):
    """A float graph's lm_head reads the tied embedding itself (Gemm transB): no transposed copy of it, Medusa heads
    that share the base lm_head included (they also read it for no rows); the engine is exact. A quantized graph
    quantizes the embedding and the lm_head each in its own layout."""
    hf = tiny_hf_models["llama_tied_linear"]
    config = __import__("json").loads((hf / "config.json").read_text())
    write_medusa_heads(tmp_path / "medusa", "v2", config["hidden_size"], config["vocab_size"], num_heads=2)
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", heads={"medusa": tmp_path / "medusa"}, progress=False)
    options = BuildOptions(weights=weights, speculative_mode=mode)
    engine_dir = build_engine(ckpt, tmp_path / "e", options, log=quiet)
    if mode != "none":
        engine, plain = Engine(engine_dir, threads=1), Engine(build_engine(ckpt, tmp_path / "n", BuildOptions()))
        for ids in PROMPTS:
            assert (
                engine.generate(input_ids=ids, max_new_tokens=12).output_ids
                == plain.generate(input_ids=ids, max_new_tokens=12).output_ids
            )
    cfg = Engine(engine_dir).manifest["model"]
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    graph = onnx.load(str(engine_dir / ef.ENGINE_ONNX), load_external_data=False).graph
    floats = [tuple(i.dims) for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    if weights == "fp32":
        assert floats.count((vocab, hidden)) == 1 and (hidden, vocab) not in floats
        gemms = [n for n in graph.node if n.op_type == "Gemm"]
        assert gemms and {a.i for n in gemms for a in n.attribute if a.name == "transB"} == {1}
    else:
        assert (vocab, hidden) not in floats and (hidden, vocab) not in floats  # both quantized
