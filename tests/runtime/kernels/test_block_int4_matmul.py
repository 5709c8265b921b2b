"""The kernel library (runtime/kernels): BlockInt4MatMul equals its numpy reference bit for bit on every instruction
set the library has (AVX-512 VNNI, AVX2, none: forced lower with SPECBUILD_KERNELS_ISA, each in a process of its
own), gives every row the same bits alone and among others, agrees with ONNX Runtime's own 4-bit kernel to float
rounding, and is what the row-invariance probe measures; the rewrite hands it the engines' matmuls and nothing else;
engines on it stay exact against their `none` engine; without it (no compiler, or SPECBUILD_KERNELS=off) the stock
kernels serve and the runtime says so."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specbuild.runtime import kernels
from specbuild.runtime.kernels.rewrite import DOMAIN, use_kernels
from tests.runtime.kernels.reference import int4_initializer, matmul_model, on_isa, reference, reference_float

SHAPES = [(32, 1), (64, 17), (96, 16), (576, 100), (1536, 40)]  # (K, N): N below, at and past a 16-column panel
# activations -> (the kernel's int8_activations attribute, its numpy reference, the stock kernel's accuracy level)
ACTIVATIONS = {"int8": (1, reference, "4"), "float": (0, reference_float, "1")}


def _cases(seed: int = 0):
    rng = np.random.default_rng(seed)
    for k, n in SHAPES:
        q = rng.integers(-8, 8, size=(k, n)).astype(np.int8)
        scales = (rng.random((k // 32, n)) * 0.05).astype(np.float32)
        scales[0, 0] = 0.0  # a zero scale
        x = (rng.standard_normal((20, k)) * rng.choice([0.1, 1.0, 30.0])).astype(np.float32)
        x[3, :32] = 0.0  # a block of zeros (scale 0)
        x[4, :31], x[4, 31] = np.arange(31) - 15.5, 127.0  # amax 127 (scale 1): each x.5 a tie, to the even integer
        yield k, n, q, scales, x


def _session(model, kernel_library: bool = True, optimized: bool = True, accuracy_level: str = "4"):
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 2, 3
    if not optimized:  # DequantizeLinear and MatMul as they are, in float (no fusion into ONNX Runtime's kernel)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", accuracy_level)
    if kernel_library:
        kernels.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _outputs_on(isa: str) -> dict:
    """Every case's outputs with int8 and with float activations in a process whose kernels run on `isa` (the
    process's instruction set is fixed at load)."""
    code = (
        "import json, sys, numpy as np\n"
        "from tests.runtime.kernels.test_block_int4_matmul import _cases, _session\n"
        "from tests.runtime.kernels.reference import matmul_model\n"
        "from specbuild.runtime import kernels\n"
        "out = {a: [_session(matmul_model(q, s, True, int8_activations=i)).run(None, {'x': x})[0].tolist()\n"
        "           for _, _, q, s, x in _cases()] for a, i in (('int8', 1), ('float', 0))}\n"
        "print(json.dumps({'isa': kernels.description(), 'out': out}))\n"
    )
    return on_isa(code, isa)


@pytest.fixture(scope="module")
def library():
    if kernels.library() is None:
        pytest.skip(kernels.description())
    return kernels.library()


def test_every_instruction_set_gives_the_reference_bits(library):
    want = {a: [ref(x, q, s) for _, _, q, s, x in _cases()] for a, (_, ref, _) in ACTIVATIONS.items()}
    seen = set()
    for isa in ("scalar", "avx2", "best"):
        got = _outputs_on(isa)
        seen.add(got["isa"])
        for activations, expected_outputs in want.items():
            for case, (expected, output) in enumerate(zip(expected_outputs, got["out"][activations])):
                output = np.asarray(output, dtype=np.float32)
                assert np.array_equal(output, expected), (got["isa"], activations, case, SHAPES[case])
    assert "specbuild kernels (scalar)" in seen and len(seen) >= 2  # the forced paths did run


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_a_row_gets_the_same_bits_alone_and_among_others(library, activations):
    int8 = ACTIVATIONS[activations][0]
    for k, n, q, s, x in _cases(seed=1):
        session = _session(matmul_model(q, s, True, int8_activations=int8))
        whole = session.run(None, {"x": x})[0]
        for start, rows in ((0, 1), (5, 1), (2, 3), (0, 8), (7, 9), (11, 9)):
            part = session.run(None, {"x": x[start : start + rows]})[0]
            assert np.array_equal(part, whole[start : start + rows]), (k, n, start, rows)
        long = np.concatenate([x, x[::-1], x, x])[:75]  # past the float path's groups of rows (48 at most)
        long_out = session.run(None, {"x": long})[0]
        assert np.array_equal(long_out[:20], whole) and np.array_equal(long_out[40:60], whole), (k, n)
        assert np.array_equal(long_out[60:75], whole[:15]) and np.array_equal(long_out[20:40], whole[::-1]), (k, n)
        three_d = _session(matmul_model(q, s, True, rows=("b", "m"), int8_activations=int8))
        batched = three_d.run(None, {"x": x[None, :6]})[0]  # leading dimensions are rows too
        assert np.array_equal(batched[0], whole[:6])


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_it_agrees_with_onnx_runtimes_own_4_bit_kernel(library, activations):
    int8, _, level = ACTIVATIONS[activations]
    for k, n, q, s, x in _cases(seed=2):
        ours = _session(matmul_model(q, s, True, int8_activations=int8)).run(None, {"x": x})[0]
        stock = _session(matmul_model(q, s, False), kernel_library=False, accuracy_level=level).run(None, {"x": x})[0]
        assert np.abs(ours - stock).max() <= 1e-4 * max(np.abs(stock).max(), 1e-6), (k, n)


def test_the_rewrite_takes_the_engines_matmuls_and_nothing_else(library):
    rng = np.random.default_rng(3)
    q = rng.integers(-8, 8, size=(64, 24)).astype(np.int8)
    s = (rng.random((2, 24)) * 0.05).astype(np.float32)

    def dq(w, name, **attrs):
        return helper.make_node("DequantizeLinear", w, [name], **{"axis": 0, "block_size": 32, **attrs})

    branch = helper.make_graph(  # an If body: a matmul on the outer initializers, rewritten too
        [dq(["w", "s"], "bw"), helper.make_node("MatMul", ["x", "bw"], ["b"])], "body", [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)],
    )  # fmt: skip
    nodes = [
        dq(["w", "s"], "w1"), helper.make_node("MatMul", ["x", "w1"], ["y1"]),  # taken
        dq(["w", "s", "zp"], "w2"), helper.make_node("MatMul", ["x", "w2"], ["y2"]),  # a zero point: kept
        dq(["w", "s16"], "w3", block_size=16), helper.make_node("MatMul", ["x", "w3"], ["y3"]),  # blocks of 16: kept
        dq(["w", "s"], "w4"), helper.make_node("MatMul", ["x", "w4"], ["y4"]),  # its weights are an output: kept
        helper.make_node("If", ["c"], ["y5"], then_branch=branch, else_branch=branch),
        dq(["w48", "s"], "w6"), helper.make_node("MatMul", ["x48", "w6"], ["y6"]),  # K = 48, a partial block: kept
    ]  # fmt: skip
    names = ("y1", "y2", "y3", "y4", "y5", "y6")
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names]
    outputs.append(helper.make_tensor_value_info("w4", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x48", TensorProto.FLOAT, [3, 48])],
        outputs,
        [int4_initializer("w", q), numpy_helper.from_array(s, "s"), int4_initializer("zp", np.zeros((2, 24), np.int8)),
         numpy_helper.from_array(np.repeat(s, 2, axis=0), "s16"), int4_initializer("w48", q[:48])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    plain = _session(model, kernel_library=False, optimized=False)
    rewritten = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    assert use_kernels(rewritten) == 3  # y1, and the If's matmul in each of its two bodies
    kinds = [(n.domain, n.op_type) for n in rewritten.graph.node]
    assert kinds.count((DOMAIN, "BlockInt4MatMul")) == 1 and kinds.count(("", "DequantizeLinear")) == 4
    if_node = next(n for n in rewritten.graph.node if n.op_type == "If")
    assert [n.op_type for n in if_node.attribute[0].g.node] == ["BlockInt4MatMul"]
    x = rng.standard_normal((3, 64)).astype(np.float32)
    feeds = {"x": x, "c": np.array(True), "x48": x[:, :48]}
    want, got = plain.run(None, feeds), _session(rewritten).run(None, feeds)
    for a, b in zip(want, got):  # float activations against int8 ones: the activations' rounding apart
        assert np.abs(a - b).max() <= 0.03 * np.abs(a).max()
    assert np.array_equal(got[0], reference(x, q, s)) and np.array_equal(got[4], got[0])


def test_without_a_compiler_or_when_turned_off_the_stock_kernels_serve(tmp_path):
    code = (
        "from specbuild.runtime import kernels\n"
        "print(kernels.library()); print(kernels.description()); print(kernels.tag())\n"
    )
    runs = {
        "off": {"SPECBUILD_KERNELS": "off"},
        "no compiler": {
            "PATH": str(tmp_path),
            "CXX": "",
            "SPECBUILD_CACHE_DIR": str(tmp_path / "cache"),
            "SPECBUILD_KERNELS": "",
        },  # fmt: skip
    }
    for name, env in runs.items():
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
        )
        assert result.returncode == 0, result.stderr
        path, description, tag = result.stdout.strip().splitlines()
        assert path == "None" and tag == "stock" and "stock kernels" in description, name
    assert "no C++ compiler" in result.stderr and result.stderr.count("note:") == 1  # said once


@pytest.mark.xdist_group("quantize")
def test_int4_engines_with_int8_activations_run_on_it_and_stay_exact(library, int8_engines):
    """The tiny int4 + int8-activation engines: their graph's matmuls and attention go to the kernel library, and the
    `ngram` engine on it gives its `none` engine's tokens, greedy and sampled."""
    import onnx

    from specbuild import engine_format as ef
    from specbuild.runtime.engine import Engine, SamplingParams

    path = int8_engines["none"] / ef.ENGINE_ORT_ONNX
    graph = next(g for g in Engine(int8_engines["none"]).manifest["graphs"] if g["file"] == ef.ENGINE_ORT_ONNX)
    source = kernels.session_source(path, ort.SessionOptions(), graph)
    assert isinstance(source, bytes)
    ops = [n.op_type for n in onnx.load_from_string(source).graph.node]
    assert "BlockInt4MatMul" in ops and "DequantizeLinear" not in ops
    assert "OrderedAttention" in ops and "GroupQueryAttention" not in ops

    def nodes(entry):
        return onnx.load_from_string(kernels.session_source(path, ort.SessionOptions(), entry)).graph.node

    float_graph = {**graph, "quantization": {**graph["quantization"], "accuracy_level": ef.ACCURACY_FLOAT32}}
    matmuls = [n for n in nodes(float_graph) if n.op_type == "BlockInt4MatMul"]  # int4, float activations
    assert matmuls and all(a.i == 0 for n in matmuls for a in n.attribute if a.name == "int8_activations")
    assert "OrderedAttention" not in [n.op_type for n in nodes(float_graph)]  # a float cache keeps ONNX Runtime's
    unquantized = {k: v for k, v in graph.items() if k != "quantization"}
    assert kernels.session_source(path, ort.SessionOptions(), unquantized) == str(path)  # nothing to take
    ops = [n.op_type for n in nodes({**unquantized, ef.GRAPH_KV_CACHE_DTYPE: ef.KV_CACHE_INT8})]
    assert "OrderedAttention" in ops and "BlockInt4MatMul" not in ops  # an int8 cache: the attention
    none, ngram = (Engine(int8_engines[m], threads=1) for m in ("none", "ngram"))
    assert ngram.exactness.to_dict()["kernels"] == kernels.description()  # said by run --json and inspect
    assert kernels.description().startswith("specbuild kernels (")
    for ids in ([1, 5, 9, 3, 7, 5, 9, 3, 7], [2, 40, 41, 2, 40]):
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=4)):
            want = none.generate(input_ids=ids, max_new_tokens=20, sampling=sampling, decode_text=False).output_ids
            assert (
                ngram.generate(input_ids=ids, max_new_tokens=20, sampling=sampling, decode_text=False).output_ids
                == want
            )
