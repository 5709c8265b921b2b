"""A large graph validated segment by segment (builder/export/graph_segments.py): the segments cover the graph's nodes
in order within the weight budget, each reads only what the graph's inputs or earlier segments give (an If body's outer
names included), and ONNX Runtime's outputs through them are the whole graph's."""

import copy

import numpy as np
import onnx
import pytest

from specbuild import engine_format as ef
from specbuild import progress
from specbuild.builder import graphs
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.export import graph_segments, validation
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, quiet
from tests.plugins.eagle_fixtures import toy_eagle3_checkpoint

pytestmark = pytest.mark.xdist_group("graphs")

EAGLE3 = dict(eagle_top_k=3, eagle_depth=3, eagle_total_tokens=8)
PROMPTS = [[1, 5, 9, 3, 7], [1, 11, 10, 6, 2, 8, 3]]


@pytest.fixture(scope="module")
def eagle3_ckpt(tmp_path_factory):
    return toy_eagle3_checkpoint(tmp_path_factory.mktemp("segments"), seed=3)


@pytest.fixture(scope="module")
def eagle3_engine(eagle3_ckpt, tmp_path_factory):
    options = BuildOptions(backends=ORT_ONLY, speculative_mode="eagle3", **EAGLE3)
    return build_engine(eagle3_ckpt, tmp_path_factory.mktemp("whole") / "engine", options, log=quiet)


def _weight_bytes(graph) -> int:
    return sum(graph_segments.initializer_bytes(t) for t in graph.initializer)


def test_segments_cover_the_graph_in_order_within_the_budget(eagle3_engine):
    graph = onnx.load(str(eagle3_engine / ef.ENGINE_ORT_ONNX), load_external_data=False).graph
    budget = _weight_bytes(graph) // 8
    segments = graph_segments.plan_segments(graph, budget)
    assert len(segments) >= 5
    assert [n.name for s in segments for n in s.nodes] == [n.name for n in graph.node]
    given = {i.name for i in graph.input}
    for segment in segments:
        # over the budget only where one node's weights are: such a node is a segment alone
        assert segment.weight_bytes <= budget or len(segment.nodes) == 1
        assert set(segment.inputs) <= given, set(segment.inputs) - given
        given |= set(segment.outputs)
    assert {o.name for o in graph.output} <= given
    drafting = next(n for n in graph.node if n.op_type == "If" and any(o.startswith("next_") for o in n.output))
    assert len(graph_segments._reads(drafting)) > len(drafting.input)  # its bodies read the target's values
    assert graph_segments.plan_segments(graph, _weight_bytes(graph)) == graph_segments.plan_segments(graph, 2**62)
    assert len(graph_segments.plan_segments(graph, _weight_bytes(graph))) == 1


def test_a_graph_validated_in_segments_gives_the_whole_graphs_outputs(eagle3_ckpt, eagle3_engine, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    whole_run = validation.run_graph
    compared = []

    def both(onnx_path, feeds, out_names, aliases, opts, segment_bytes=None, log=None):
        whole = whole_run(onnx_path, copy.deepcopy(feeds), out_names, aliases, opts)
        parts = whole_run(onnx_path, feeds, out_names, aliases, opts, segment_bytes, log)
        for w, p in zip(whole, parts):
            for name in out_names:
                if np.issubdtype(w[name].dtype, np.floating):
                    np.testing.assert_allclose(p[name], w[name], rtol=0, atol=1e-5, err_msg=name)
                else:
                    np.testing.assert_array_equal(p[name], w[name], err_msg=name)
        compared.append(len(parts))
        return parts

    graph = onnx.load(str(eagle3_engine / ef.ENGINE_ORT_ONNX), load_external_data=False).graph
    monkeypatch.setattr(validation, "run_graph", both)
    monkeypatch.setattr(graphs, "SMALL_GRAPH_BYTES", 0)  # a large float graph: validated with large_validation
    monkeypatch.setattr(graphs, "SEGMENT_BYTES", _weight_bytes(graph) // 5)
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.1)  # the trace says it runs
    logs = []
    options = BuildOptions(backends=ORT_ONLY, speculative_mode="eagle3", **EAGLE3)
    parts = build_engine(eagle3_ckpt, tmp_path / "parts", options, log=lambda line: logs.append(str(line)))
    assert len(compared) == 1 and compared[0] >= 4  # the graph's check calls, through the segments
    assert sum(line.startswith("segment ") for line in logs) >= 5, logs
    assert any(line.startswith("tracing and optimizing the eagle3 step graph: done in ") for line in logs), logs
    assert not [p for p in parts.iterdir() if ".segment" in p.name]  # the segments' files are gone
    a, b = Engine(eagle3_engine, threads=1), Engine(parts, threads=1)
    for ids in PROMPTS:
        assert (
            a.generate(input_ids=ids, max_new_tokens=16).output_ids
            == b.generate(input_ids=ids, max_new_tokens=16).output_ids
        )
