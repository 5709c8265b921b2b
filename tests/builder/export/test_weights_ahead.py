"""Weights written while the graph is traced (builder/export/weights_ahead.py): the engine holds the same tensors as one
whose weights are all written after the trace; a planned layout the graph does not take is written again, never
wrong; the torch reference reads the written bytes; a failed write fails the build; the file's checksum is taken
as it is written."""

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from specbuild import engine_format as ef
from specbuild.builder.build import BuildOptions, build_engine
from specbuild.builder.checkpoint.canonical import Checkpoint
from specbuild.builder.export import weights_ahead
from specbuild.builder.export.weights_file import WEIGHTS_FILE
from specbuild.builder.network.lazy_network import skeleton, streamed
from specbuild.errors import SpecbuildError
from specbuild.runtime import integrity
from specbuild.runtime.engine import Engine
from tests.helpers import ORT_ONLY, quiet

pytestmark = pytest.mark.xdist_group("tiny")

SHAPE = "qwen2_bias"  # untied lm_head, biases: every kind of network weight


def _tensors(engine_dir) -> dict[str, np.ndarray]:
    """Every initializer of the engine's ONNX Runtime graph by name, with its values."""
    model = onnx.load(str(engine_dir / ef.ENGINE_ORT_ONNX))  # its weights from the engine directory
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.fixture(scope="module")
def unplanned(tiny_checkpoints, tmp_path_factory):
    """The engine with nothing written ahead: every weight written after the trace."""
    patch = pytest.MonkeyPatch()
    patch.setattr(weights_ahead, "planned_weights", lambda step, weight: [])
    try:
        out = tmp_path_factory.mktemp("ahead") / "unplanned"
        return build_engine(tiny_checkpoints[SHAPE], out, BuildOptions(backends=ORT_ONLY), log=quiet)
    finally:
        patch.undo()


def test_the_engine_holds_the_same_tensors_as_one_written_after_the_trace(tiny_checkpoints, unplanned, tmp_path,
                                                                          monkeypatch):  # fmt: skip
    seen = []
    finish = weights_ahead.WeightsAhead.finish

    def recorded(self, advance=None):
        finish(self, advance)
        seen.append((len(self.entries), self.unclaimed(), self.sha256))

    monkeypatch.setattr(weights_ahead.WeightsAhead, "finish", recorded)
    engine_dir = build_engine(tiny_checkpoints[SHAPE], tmp_path / "e", BuildOptions(backends=ORT_ONLY), log=quiet)
    # the layers' weights and the embedding were written ahead, each taken by the graph in its planned layout
    ((planned, unclaimed, sha256),) = seen
    assert planned >= 2 * 4 + 1 and unclaimed == []
    want, got = _tensors(unplanned), _tensors(engine_dir)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the checksum taken as the file was written is the file's
    manifest = Engine(engine_dir).manifest
    assert manifest["checksums"][WEIGHTS_FILE]["sha256"] == sha256 == integrity.file_sha256(engine_dir / WEIGHTS_FILE)


def test_a_layout_the_graph_does_not_take_is_written_again(tiny_checkpoints, unplanned, tmp_path, monkeypatch):
    planned = weights_ahead.planned_weights

    def one_wrong(step, weight):  # a layer weight planned as it is, where the graph reads it transposed
        entries = planned(step, weight)
        wrong = next(e for e in entries if e.perm is not None)
        wrong.perm, wrong.shape = None, wrong.shape[::-1]
        wrong.make = lambda _, source=wrong.name.removeprefix("net."): iter([(0, weight(source).numpy())])
        return entries

    monkeypatch.setattr(weights_ahead, "planned_weights", one_wrong)
    lines = []
    engine_dir = build_engine(tiny_checkpoints[SHAPE], tmp_path / "e", BuildOptions(backends=ORT_ONLY),
                              log=lines.append)  # fmt: skip
    assert any("in a layout the graph does not take" in line for line in lines)
    want, got = _tensors(unplanned), _tensors(engine_dir)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    a, b = Engine(unplanned, threads=1), Engine(engine_dir, threads=1)
    ids = [1, 5, 9, 3, 7]
    assert (
        a.generate(input_ids=ids, max_new_tokens=12).output_ids
        == b.generate(input_ids=ids, max_new_tokens=12).output_ids
    )


def test_the_reference_reads_the_written_bytes_in_the_networks_layout(tiny_checkpoints, tmp_path):
    from specbuild.builder.network.step import StepModule
    from specbuild.plugins.none.graph import NonePlugin

    ckpt = Checkpoint.load(tiny_checkpoints[SHAPE])
    net = skeleton(ckpt.model, ckpt.tensors(), "float32")
    step = StepModule(net, NonePlugin())
    ahead = weights_ahead.WeightsAhead(step, tmp_path / "g.onnx", net.weight)
    ahead.start()
    try:
        ahead.finish()
        names = [e.name.removeprefix("net.") for e in ahead.entries]
        assert any(e.perm == (1, 0) for e in ahead.entries) and "embed_tokens.weight" in names
        for name in names:
            view = ahead.tensor(name)
            assert view is not None and view.shape == net.weight(name).shape
            np.testing.assert_array_equal(view.numpy(), net.weight(name).numpy(), err_msg=name)
        assert ahead.tensor("lm_head.weight") is None  # not written ahead: read from the checkpoint
        assert ahead.sha256 == integrity.file_sha256(ahead.path)
        # a reference holding what it reads keeps what it converted from the checkpoint, not views of the file
        reference = streamed(ckpt.model, ckpt.tensors(), "float32")
        with reference.reading(ahead.tensor), reference.holding(1 << 30):
            layer = reference.read_weight(names[-1])
            np.testing.assert_array_equal(layer.numpy(), net.weight(names[-1]).numpy())
            reference.read_weight("lm_head.weight")
            assert list(reference._held) == ["lm_head.weight"]
    finally:
        ahead.close()
    assert ahead.tensor(names[0]) is None  # let go of the file


def _made(entry, make=None) -> np.ndarray:
    """The whole array an entry's make gives in pieces (each copied before the next is made)."""
    data = bytearray(entry.length)
    for start, piece in (make or entry.make)(weights_ahead._Scratch()):
        raw = piece.tobytes()
        data[start : start + len(raw)] = raw
    return np.frombuffer(bytes(data), dtype=entry.dtype).reshape(entry.shape)


@pytest.mark.parametrize("stored, engine", [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "float16")])
def test_planned_weights_are_made_from_the_checkpoint_as_the_network_reads_them(
    tiny_checkpoints, monkeypatch, stored, engine
):
    """Each weight written ahead, made in pieces through reused buffers from the checkpoint's unconverted tensors
    (packed projections joined, layer weights moved in the checkpoint's dtype, then converted), is the network's
    weight in its stored layout, byte for byte."""
    from specbuild.builder.network.step import StepModule
    from specbuild.plugins.none.graph import NonePlugin

    monkeypatch.setattr(weights_ahead, "_PIECE_BYTES", 1000)  # the embedding in many pieces
    ckpt = Checkpoint.load(tiny_checkpoints[SHAPE])
    dtype = getattr(torch, stored)
    tensors = ckpt.tensors().cast(lambda name: dtype, lambda tensor, name: tensor.to(dtype))
    net = skeleton(ckpt.model, tensors, engine)
    entries = weights_ahead.planned_weights(StepModule(net, NonePlugin()), net.weight)
    names = {e.name.removeprefix("net.") for e in entries}
    assert {"embed_tokens.weight", "layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.down_proj.weight"} <= names
    scratch = weights_ahead._Scratch()
    for entry in entries:
        want = net.weight(entry.name.removeprefix("net."))
        if entry.perm is not None:
            want = want.permute(entry.perm)
        pieces = [(start, piece.copy()) for start, piece in entry.make(scratch)]
        assert len(pieces) > 1 or entry.perm is not None, entry.name
        np.testing.assert_array_equal(_made(entry), want.contiguous().numpy(), err_msg=entry.name)


def test_a_weight_read_before_it_is_written_waits_for_its_write(tiny_checkpoints, tmp_path):
    """A graph pass between the trace and the save may read a planned weight (the optimizer's rewrite rules read the
    norms' values): it gets the written bytes, never the file's zeros before them."""
    import threading

    import onnx_ir as ir

    from specbuild.builder.network.step import StepModule
    from specbuild.plugins.none.graph import NonePlugin

    ckpt = Checkpoint.load(tiny_checkpoints[SHAPE])
    net = skeleton(ckpt.model, ckpt.tensors(), "float32")
    ahead = weights_ahead.WeightsAhead(StepModule(net, NonePlugin()), tmp_path / "g.onnx", net.weight)
    entry = ahead.entries[-1]
    gate, make = threading.Event(), entry.make
    entry.make = lambda scratch: (gate.wait(), make(scratch))[1]  # its write waits until the read below has started
    ahead.start()
    try:
        tensor = ahead.external(entry, ir.DataType.FLOAT, ir.Shape(entry.shape), "w")
        threading.Timer(0.3, gate.set).start()
        np.testing.assert_array_equal(tensor.numpy(), _made(entry, make))
        ahead.finish()
    finally:
        ahead.close()


def test_a_failed_write_fails_the_build(tiny_checkpoints, tmp_path, monkeypatch):
    planned = weights_ahead.planned_weights

    def failing(step, weight):
        entries = planned(step, weight)

        def fail(scratch):
            raise OSError("No space left on device")

        entries[-1].make = fail
        return entries

    monkeypatch.setattr(weights_ahead, "planned_weights", failing)
    with pytest.raises((SpecbuildError, OSError), match="No space left on device"):
        build_engine(tiny_checkpoints[SHAPE], tmp_path / "e", BuildOptions(backends=ORT_ONLY), log=quiet)
    assert not (tmp_path / "e").exists()
