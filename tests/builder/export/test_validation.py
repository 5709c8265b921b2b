"""Export validation: a graph that computes a token otherwise is refused; a choice torch made at a near-tie is
counted, not refused (DecisionMargins); graphs too large to validate whole are validated on their first layers and
checked whole on a prompt, and build the same engines."""

import numpy as np
import onnx
import pytest
import torch
import yaml
from onnx import TensorProto, helper

from specbuild import engine_format as ef
from specbuild.builder import graphs
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.export import exporter, graph_segments, validation
from specbuild.builder.network.llama import LlamaNetwork
from specbuild.builder.network.step import StepModule
from specbuild.errors import SpecbuildError
from specbuild.plugins.none.graph import NonePlugin
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, quiet
from tests.tiers import full

pytestmark = pytest.mark.xdist_group("tiny")


def test_margins_of_selections_and_comparisons():
    with validation.DecisionMargins() as m:
        torch.tensor([[1.0, 3.0, 2.5]]).argmax(-1)
    assert m.margin == pytest.approx(0.5)
    with validation.DecisionMargins() as m:
        torch.topk(torch.tensor([5.0, 1.0, 4.0, 3.9]), 2)
    assert m.margin == pytest.approx(0.1)  # the boundary: 4.0 chosen over 3.9
    with validation.DecisionMargins() as m:
        _ = torch.tensor([0.30, 0.70]) <= torch.tensor(0.3005)
    assert m.margin == pytest.approx(0.0005, rel=1e-4)  # float32 values
    with validation.DecisionMargins() as m:
        _ = torch.arange(5) < 3  # integers: no rounding, no margin
    assert m.margin == float("inf")


@pytest.fixture(scope="module")
def none_graph(tiny_checkpoints, tmp_path_factory):
    ckpt = Checkpoint.load(tiny_checkpoints["llama_gqa_llama3rope"])
    step = StepModule(LlamaNetwork.from_tensors(ckpt.model, ckpt.tensors()), NonePlugin()).eval()
    path = tmp_path_factory.mktemp("validation") / ef.ENGINE_ONNX
    exporter.export_step(step, path)
    return step, path


def _plus_one(path, output, dtype=TensorProto.INT64):
    """The graph at `path` with `output` computed plus one: a graph that picks another token (int64), or whose float
    output is off."""
    model = onnx.load(str(path), load_external_data=False)
    node = next(n for n in model.graph.node if output in n.output)
    node.output[list(node.output).index(output)] = f"{output}.before"
    model.graph.initializer.append(helper.make_tensor("one", dtype, [], [1]))
    model.graph.node.append(helper.make_node("Add", [f"{output}.before", "one"], [output]))
    broken = path.with_name(f"broken.{path.name}")
    onnx.save(model, str(broken))
    return broken


def test_a_graph_that_picks_another_token_is_refused_and_a_near_tie_is_counted(none_graph, monkeypatch):
    step, path = none_graph
    assert validation.validate_export(step, path, 1e-3)["near_ties"] == 0
    broken = _plus_one(path, ef.NEXT_INPUT_IDS)
    with pytest.raises(SpecbuildError, match="output next_input_ids differs between torch and ONNX Runtime"):
        validation.validate_export(step, broken, 1e-3)
    monkeypatch.setattr(validation, "decision_margin", lambda step, args: 0.0)  # as if every choice were a tie
    result = validation.validate_export(step, broken, 1e-3)
    assert result["near_ties"] > 0 and result["max_abs_diff"] < 1e-3


def test_torch_outputs_computed_ahead_check_the_graph_the_same(none_graph, monkeypatch):
    """A large float graph's torch calls run in a thread while its file is written (TorchOutputsAhead): the same
    verdicts as computing them after ONNX Runtime's, and the thread's own failure reaches the build."""
    step, path = none_graph

    def ahead():
        started = validation.TorchOutputsAhead(step, hold=0)
        started.start()
        return started

    inline = validation.validate_export(step, path, 1e-3)
    assert validation.validate_export(step, path, 1e-3, reference=ahead()) == inline
    broken = _plus_one(path, ef.NEXT_INPUT_IDS)
    with pytest.raises(SpecbuildError, match="output next_input_ids differs between torch and ONNX Runtime"):
        validation.validate_export(step, broken, 1e-3, reference=ahead())
    # the margins come from the reference's own forwards (its weights are gone by then): no second look
    monkeypatch.setattr(validation, "decision_margin", lambda step, args: pytest.fail("a second look"))
    real = validation.torch_outputs
    monkeypatch.setattr(validation, "torch_outputs",
                        lambda step, margins, log=None: [(o, 0.0) for o, _ in real(step, margins)])  # fmt: skip
    assert validation.validate_export(step, broken, 1e-3, reference=ahead())["near_ties"] > 0

    def fails(step, margins, log=None):
        raise RuntimeError("the reference failed")

    monkeypatch.setattr(validation, "torch_outputs", fails)
    with pytest.raises(RuntimeError, match="the reference failed"):
        validation.validate_export(step, path, 1e-3, reference=ahead())


def test_a_float_output_off_is_refused_unless_a_choice_behind_it_was_a_near_tie(none_graph, monkeypatch):
    step, path = none_graph
    model = onnx.load(str(path), load_external_data=False)
    floating = next(o.name for o in model.graph.output if o.type.tensor_type.elem_type == TensorProto.FLOAT)
    broken = _plus_one(path, floating, TensorProto.FLOAT)
    with pytest.raises(SpecbuildError, match="max abs diff 1 exceeds"):
        validation.validate_export(step, broken, 1e-3)
    monkeypatch.setattr(validation, "decision_margin", lambda step, args: 0.0)  # every call made a choice at a tie
    assert validation.validate_export(step, broken, 1e-3)["near_ties"] > 0


def test_a_graph_validated_in_segments_is_checked_alike(none_graph):
    """A graph run segment by segment (segment_bytes: graph_segments.py) gets the whole graph's verdicts: passed
    within the bound, refused where it picks another token or a float output is off."""
    step, path = none_graph
    graph = onnx.load(str(path), load_external_data=False).graph
    budget = sum(graph_segments.initializer_bytes(t) for t in graph.initializer) // 4
    logs = []
    parts = validation.validate_export(step, path, 1e-3, segment_bytes=budget, log=logs.append)
    whole = validation.validate_export(step, path, 1e-3)
    assert parts["near_ties"] == whole["near_ties"] == 0 and parts["max_abs_diff"] < 1e-3
    assert len(logs) >= 3 and logs[-1].startswith(f"segment {len(logs)}/{len(logs)} ")
    with pytest.raises(SpecbuildError, match="output next_input_ids differs between torch and ONNX Runtime"):
        validation.validate_export(step, _plus_one(path, ef.NEXT_INPUT_IDS), 1e-3, segment_bytes=budget)
    floating = next(o.name for o in graph.output if o.type.tensor_type.elem_type == TensorProto.FLOAT)
    with pytest.raises(SpecbuildError, match="max abs diff 1 exceeds"):
        validation.validate_export(step, _plus_one(path, floating, TensorProto.FLOAT), 1e-3, segment_bytes=budget)


@pytest.mark.parametrize(
    "mode,options",
    [
        ("none", dict(weights="int4", int8_activations=True)),  # checked on a truncated network
        pytest.param("none", {}, marks=full("another precision (float: checked whole)")),
        pytest.param("ngram", dict(num_draft_tokens=3), marks=full("another mode")),
    ],
)
def test_graphs_too_large_to_validate_whole_build_the_same_engines(tiny_checkpoints, tmp_path, monkeypatch, mode,
                                                                   options):  # fmt: skip
    ckpt = tiny_checkpoints["qwen2_bias"]
    opts = dict(backends=ORT_ONLY, speculative_mode=mode, **options)
    whole = build_engine(ckpt, tmp_path / "whole", BuildOptions(**opts), log=quiet)
    monkeypatch.setattr(graphs, "SMALL_GRAPH_BYTES", 0)
    monkeypatch.setattr(graphs, "TRUNCATED_LAYERS", 1)  # the tiny models have 2 layers
    parts = build_engine(ckpt, tmp_path / "parts", BuildOptions(**opts), log=quiet)
    graph = yaml.safe_load((parts / ef.ENGINE_MANIFEST).read_text())["graphs"][0]
    # a float graph of any size is checked call by call whole; a large quantized one on a truncated float network
    assert graph["validation"].get("layers") == (1 if "weights" in options else None)
    assert ("quantization" in graph) == ("weights" in options)
    a, b = Engine(whole, threads=1), Engine(parts, threads=1)
    for ids in ([1, 5, 9, 3, 7], [1, 4], [2, 11, 10, 6]):
        assert (
            a.generate(input_ids=ids, max_new_tokens=16).output_ids
            == b.generate(input_ids=ids, max_new_tokens=16).output_ids
        )
    files = sorted(p.name for p in parts.iterdir())
    assert files == sorted(p.name for p in whole.iterdir()) and not any(f.startswith(".truncated") for f in files)
    np.testing.assert_equal((parts / "weights.bin").stat().st_size, (whole / "weights.bin").stat().st_size)
