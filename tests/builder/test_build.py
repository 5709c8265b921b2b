"""Engine build: manifest contents, TensorRT-parseable graphs, recipes, atomic output on failure."""

import onnx
import pytest
import yaml

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.export.trt_compat import lint_onnx_for_tensorrt
from specbuild.errors import SpecbuildError
from tests.helpers import quiet
from tests.shapes import TINY_ENGINE_SHAPES
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("tiny")


def test_manifest_records_format_limits_and_io(tiny_engines):
    manifest = yaml.safe_load((tiny_engines["qwen2_bias"] / ef.ENGINE_MANIFEST).read_text())
    assert manifest["format"] == ef.ENGINE_FORMAT and manifest["format_version"] == ef.ENGINE_FORMAT_VERSION
    assert manifest["speculative_mode"] == "none" and manifest["lossless"] is True
    assert manifest["limits"]["max_seq_len"] == 128
    graphs = {g["backend"]: g for g in manifest["graphs"]}
    assert set(graphs) == {ef.BACKEND_ONNXRUNTIME, ef.BACKEND_TENSORRT}
    portable, fused = graphs[ef.BACKEND_TENSORRT], graphs[ef.BACKEND_ONNXRUNTIME]
    inputs = {i["name"]: i for i in portable["io"]["inputs"]}
    assert {ef.INPUT_IDS, ef.TREE_MASK, ef.PATHS, ef.KV_CACHE, ef.RAND_ACCEPT} <= set(inputs)
    assert inputs[ef.TREE_MASK]["dtype"] == "bool"
    outputs = {o["name"] for o in portable["io"]["outputs"]}
    assert {ef.ACCEPTED_TOKENS, ef.NUM_ACCEPTED, ef.ACCEPTED_NODES, ef.NEW_KV, ef.NEXT_INPUT_IDS} <= outputs
    fused_in = {i["name"] for i in fused["io"]["inputs"]}
    fused_out = {o["name"] for o in fused["io"]["outputs"]}
    assert ef.KV_CACHE not in fused_in and {"past_key_0", "past_value_1"} <= fused_in
    assert ef.NEW_KV not in fused_out and {"present_key_0", "present_value_1"} <= fused_out
    assert (portable["kv_cache"], fused["kv_cache"]) == (ef.KV_STACKED, ef.KV_SHARED)
    assert all(g["weights"] == "fp32" and g["validation"]["max_abs_diff"] < 1e-3 for g in graphs.values())
    assert all(g["opset"] == 18 for g in graphs.values()) and "opset" not in manifest  # per graph: int4 is 21
    assert manifest["weights"]["mode_weights"] == "float32"
    assert manifest["weights"]["file"] == "weights.bin"


@pytest.mark.parametrize("shape", TINY_ENGINE_SHAPES)
def test_every_exported_graph_passes_the_tensorrt_operator_check(tiny_engines, shape):
    model = onnx.load(str(tiny_engines[shape] / ef.ENGINE_ONNX), load_external_data=False)
    assert lint_onnx_for_tensorrt(model) == []
    assert {o.domain: o.version for o in model.opset_import}.get("", 0) == 18


def test_graphs_name_no_source_file_of_the_build(tiny_engines):
    """The tracer records no Python stack per node (builder/export/lean_export.lean_tracing): no checkout path in a
    graph; the module paths builder/quantize/blockwise.py reads stay."""
    for name in (ef.ENGINE_ONNX, ef.ENGINE_ORT_ONNX):
        model = onnx.load(str(tiny_engines["qwen2_bias"] / name), load_external_data=False)
        meta = [{p.key: p.value for p in node.metadata_props} for node in model.graph.node]
        assert not [m for m in meta if "specbuild" in m.get("pkg.torch.onnx.stack_trace", "")]
        assert sum("net.layers.0" in m.get("namespace", "") for m in meta) > 5


def test_recipe_options_and_overrides(tmp_path, tiny_checkpoints):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("build:\n  speculative_mode: none\n  max_seq_len: 64\n")
    opts = BuildOptions.from_recipe(recipe, max_seq_len=32)
    assert opts.max_seq_len == 32 and opts.speculative_mode == "none"
    recipe.write_text("build:\n  max_seq_length: 64\n")
    with pytest.raises(SpecbuildError, match="max_seq_length"):
        BuildOptions.from_recipe(recipe)


def test_failed_build_leaves_no_output(tmp_path, tiny_checkpoints, monkeypatch):
    import specbuild.builder.export.exporter as exporter

    def boom(step, path, **kwargs):  # the graph half written, then refused (without the trace it would take)
        path.write_bytes(b"\x08\x09")
        raise SpecbuildError("export validation: max abs diff 1 exceeds 0.001")

    monkeypatch.setattr(exporter, "export_step", boom)
    with pytest.raises(SpecbuildError, match="export validation"):
        build_engine(tiny_checkpoints["qwen2_bias"], tmp_path / "engine", BuildOptions(), log=quiet)
    assert not (tmp_path / "engine").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".engine")]
    with pytest.raises(SpecbuildError, match="max-seq-len"):
        build_engine(tiny_checkpoints["qwen2_bias"], tmp_path / "engine", BuildOptions(max_seq_len=100000), log=quiet)
    with pytest.raises(SpecbuildError, match="speculative-mode"):
        build_engine(tiny_checkpoints["qwen2_bias"], tmp_path / "engine", BuildOptions(speculative_mode="x"), log=quiet)
    assert not (tmp_path / "engine").exists()


@full("a bfloat16 checkpoint: a build of its own")
def test_bfloat16_checkpoint_builds_an_exact_float32_engine(tmp_path, tiny_hf_models):
    import numpy as np
    import torch

    from specbuild.builder.checkpoint.convert import convert_checkpoint
    from specbuild.runtime.engine import Engine
    from tests.shapes import tiny_hf_model

    ckpt = convert_checkpoint(tiny_hf_models["qwen2_bias"], tmp_path / "ckpt", dtype="bfloat16", progress=False)
    engine = Engine(build_engine(ckpt, tmp_path / "engine", BuildOptions(output_logits=True), log=quiet), threads=1)
    assert engine.manifest["dtype"] == "float32" and engine.manifest["checkpoint_dtype"] == "bfloat16"
    model = tiny_hf_model("qwen2_bias")
    with torch.no_grad():  # the same bf16-rounded weights (parameters only: rotary buffers stay exact)
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    ids = [1, 5, 9, 13, 7]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(engine.prefill_logits(ids) - want).max() < 1e-4


def test_graph_metadata_names_no_memory_address():
    """builder/export/exporter.stable_metadata: a node from a Python function (torch's sym_min) keeps its name, not the
    address the exporter wrote beside it, in a branch of an If too."""
    import onnx_ir as ir

    from specbuild.builder.export.exporter import stable_metadata

    x = ir.Value(name="x")
    inner = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(1.0))], name="inner")
    inner.metadata_props["namespace"] = ": Step/sym_max_4: <function sym_max at 0x7fd01ecd76a0>"
    branch = ir.Graph([], inner.outputs, nodes=[inner], name="then")
    outer = ir.Node("", "If", [x], [ir.AttrGraph("then_branch", branch)], name="if")
    outer.metadata_props["pkg.torch.onnx.class_hierarchy"] = "['Step', '<function sym_min at 0x7fc253ae77e0>']"
    model = ir.Model(ir.Graph([x], outer.outputs, nodes=[outer], opset_imports={"": 18}), ir_version=10)
    stable_metadata(model)
    assert outer.metadata_props["pkg.torch.onnx.class_hierarchy"] == "['Step', '<function sym_min>']"
    assert inner.metadata_props["namespace"] == ": Step/sym_max_4: <function sym_max>"
