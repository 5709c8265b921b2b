"""Row invariance of an engine's CPU kernels, measured on the machine that runs the engine.

An engine with int8 activations or an int8 KV cache reproduces its `none` engine bit for bit only if every row-wise
kernel gives a token the same bits whatever the number of rows in the call: the int8 roundings of the next layer's
input or of the cached keys and values amplify any last-bit difference (builder/network/ort_kernels.py says which
kernels differ on which CPUs). That is a property of the CPU, so it is measured where the engine runs. The probe
rebuilds every kernel configuration the graph holds -- block-quantized MatMul (which ONNX Runtime fuses into
MatMulNBits, as in the engine), MatMulNBits, the integer GEMM (MatMulIntegerToFloat, builder/quantize/int8_gemm.py),
float MatMul, GroupQueryAttention with the node's own inputs, the norms and the SiLU -- with random weights of the
same shapes, on the kernels the engine runs on (specbuild's own where runtime/kernels takes them), runs each on calls of
1..R rows (R: MAX_PROBE_ROWS, or the most rows one of the engine's calls holds) under the engine's own session
settings, and compares the bits row by row.

Per kernel the result is `rows_from`: the smallest M such that every call of M or more rows gives each row the bits
of the longest call (1: invariant; None: calls of several rows disagree, no padding makes it exact). The engine pads
every call to the largest M any kernel needs (its `min_rows` input, see engine_format) -- attention is padded to
attention_pad + 1 rows inside the graph already -- or has no exact path on this CPU.

Measured once per graph file, CPU, ONNX Runtime version and thread count: the verdict is kept in the user cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from specbuild import engine_format as ef
from specbuild.runtime import kernels as own_kernels
from specbuild.runtime import user_cache

MAX_PROBE_ROWS = 16  # rows of the longest probed call at least (a root and 15 chain drafts)
PASTS = (3, 45)  # cached positions before an attention call's rows
CACHE_NAME = "row-invariance"
PROBE_VERSION = 2  # in the cache key: a change to what the probe measures invalidates the kept verdicts
DENSE_ROWS = 16  # every row count up to this is probed; above it a geometric sample up to the longest call
INT8_CACHE_SCALE = 0.03  # an int8-cache attention's probe: a unit normal's range over 127 steps
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "sve")


@dataclasses.dataclass
class Verdict:
    """What the probe found for one graph on this machine."""

    kernels: dict[str, int | None]  # kernel configuration -> rows_from
    cpu: str
    seconds: float  # probe time when measured
    cached: bool = False
    min_rows: int | None = None  # set by check_graph: the step padding for exactness (None: no exact path)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_description() -> str:
    """The CPU model and the instruction-set extensions that select ONNX Runtime's kernels."""
    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    present = [f for f in ISA_FLAGS if f in flags]
    return f"{model} ({' '.join(present) if present else 'no AVX2' if flags else 'flags unknown'})"


def cpu_key() -> str:
    """A hash of what selects the kernels: architecture, CPU model and every flag."""
    info = _cpuinfo()
    parts = [platform.machine(), info.get("model name", ""), info.get("flags", info.get("Features", ""))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- probed kernels
@dataclasses.dataclass
class Kernel:
    """One kernel configuration: its nodes and random weights, its inputs (fed for any number of rows and cached
    length by `feeds`), and its outputs with the axis that holds the rows ("slots": a KV buffer's rows sit after the
    cached length on axis 2)."""

    name: str
    nodes: list
    initializers: list
    inputs: list
    outputs: dict[str, int | str]
    feeds: Callable[[int, int], dict]
    attention: bool = False


def _random_initializer(helper, name: str, like, rng):
    """A random tensor with the dims and type of `like` (int4 packed two per byte; floats small and positive, as
    scales and norm weights are)."""
    from onnx import TensorProto

    count = int(np.prod(list(like.dims))) if like.dims else 1
    kind = like.data_type
    if kind in (TensorProto.INT4, TensorProto.UINT4, TensorProto.UINT8, TensorProto.INT8):
        size = (count + 1) // 2 if kind in (TensorProto.INT4, TensorProto.UINT4) else count
        raw = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
    elif kind == TensorProto.FLOAT:
        raw = rng.uniform(0.002, 0.02, size=count).astype(np.float32).tobytes()
    elif kind == TensorProto.FLOAT16:
        raw = rng.uniform(0.002, 0.02, size=count).astype(np.float16).tobytes()
    else:
        raise ValueError(f"no random tensor of ONNX type {kind}")
    return helper.make_tensor(name, kind, list(like.dims), raw, raw=True)


def _rows_of(seed: int, width: int, max_rows: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, max_rows, width)).astype(dtype)


class _Collector:
    """Collects the kernel configurations of an engine graph (onnx.ModelProto; external data not needed)."""

    def __init__(self, model, max_rows: int = MAX_PROBE_ROWS):
        from onnx import TensorProto, helper

        self.h, self.tp, self.max_rows = helper, TensorProto, max_rows
        graph = model.graph
        self.inits = {i.name: i for i in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.graph_inputs = {i.name: i for i in graph.input}
        self.kernels: dict[str, Kernel] = {}
        self.rng = np.random.default_rng(0)
        for node in graph.node:
            handler = {
                ("", "MatMul"): self.matmul,
                ("com.microsoft", "MatMulNBits"): self.matmul_nbits,
                ("com.microsoft", "MatMulIntegerToFloat"): self.integer_matmul,
                ("com.microsoft", "GroupQueryAttention"): self.attention,
                ("com.microsoft", "SkipSimplifiedLayerNormalization"): self.norms,
            }.get((node.domain or "", node.op_type))
            if handler is not None:
                handler(node)

    def attrs(self, node) -> dict:
        return {a.name: self.h.get_attribute_value(a) for a in node.attribute}

    def _row_kernel(self, name: str, width: int, nodes_for: Callable[[str], list], inits: list, dtype: int) -> None:
        """A kernel reading one [1, rows, width] input `p+x` and writing `p+y`."""
        p = f"k{len(self.kernels)}_"
        data = _rows_of(len(self.kernels), width, self.max_rows, np.float16 if dtype == self.tp.FLOAT16 else np.float32)
        for t in inits:
            t.name = p + t.name
        self.kernels[name] = Kernel(
            name, nodes_for(p), inits, [self.h.make_tensor_value_info(p + "x", dtype, [1, "rows", width])],
            {p + "y": 1}, lambda rows, past: {p + "x": data[:, :rows]},
        )  # fmt: skip

    def matmul(self, node) -> None:
        """MatMul(x, DequantizeLinear(blocks)) -- fused into MatMulNBits at the session's accuracy level, as in the
        engine -- or MatMul(x, float weight)."""
        weight = node.input[1]
        dq = self.producer.get(weight)
        if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in self.inits:
            q = self.inits[dq.input[0]]
            k, n = list(q.dims)
            attrs = self.attrs(dq)
            sources = [s for s in dq.input if s]
            name = f"MatMulNBits {k}x{n} block {attrs.get('block_size')}" + (" zero points" if len(sources) > 2 else "")
            if name in self.kernels or any(s not in self.inits for s in sources):
                return
            inits = [_random_initializer(self.h, f"i{j}", self.inits[s], self.rng) for j, s in enumerate(sources)]
            dtype = self.inits[sources[1]].data_type

            def nodes(p, count=len(sources), attrs=attrs):
                return [
                    self.h.make_node("DequantizeLinear", [f"{p}i{j}" for j in range(count)], [p + "w"], **attrs),
                    self.h.make_node("MatMul", [p + "x", p + "w"], [p + "y"]),
                ]

            self._row_kernel(name, k, nodes, inits, dtype)
        elif weight in self.inits and len(self.inits[weight].dims) == 2:
            w = self.inits[weight]
            k, n = list(w.dims)
            name = f"MatMul {k}x{n}"
            if name not in self.kernels:
                inits = [_random_initializer(self.h, "i0", w, self.rng)]
                self._row_kernel(name, k, lambda p: [self.h.make_node("MatMul", [p + "x", p + "i0"], [p + "y"])],
                                 inits, w.data_type)  # fmt: skip

    def matmul_nbits(self, node) -> None:
        attrs = self.attrs(node)
        k, n = int(attrs["K"]), int(attrs["N"])
        name = (
            f"MatMulNBits {k}x{n} int{attrs.get('bits', 4)} block {attrs.get('block_size')} "
            f"level {attrs.get('accuracy_level', 0)}"
        )
        sources = list(node.input[1:])
        if name in self.kernels or any(s and s not in self.inits for s in sources):
            return
        inits = [_random_initializer(self.h, f"i{j}", self.inits[s], self.rng) for j, s in enumerate(sources) if s]

        def nodes(p):
            inputs = [p + "x"] + [f"{p}i{j}" if s else "" for j, s in enumerate(sources)]
            return [self.h.make_node("MatMulNBits", inputs, [p + "y"], domain="com.microsoft", **attrs)]

        self._row_kernel(name, k, nodes, inits, self.tp.FLOAT)

    def integer_matmul(self, node) -> None:
        """MatMulIntegerToFloat(uint8 rows, int8 weights, scales, zero points) -- builder/quantize/int8_gemm.py's GEMM
        -- with its rows made from float ones (x * 60 + 128, clipped, cast)."""
        wq = self.inits.get(node.input[1])
        if wq is None or len(wq.dims) != 2:
            return
        k, n = list(wq.dims)
        name = f"MatMulIntegerToFloat {k}x{n}"
        sources = list(node.input[1:])
        if name in self.kernels or any(s and s not in self.inits for s in sources):
            return
        h = self.h
        inits = [_random_initializer(h, f"i{j}", self.inits[s], self.rng) for j, s in enumerate(sources) if s]
        constants = (("c60", 60.0), ("c128", 128.0), ("c0", 0.0), ("c255", 255.0))  # float rows -> uint8 ones
        inits += [h.make_tensor(label, self.tp.FLOAT, [], [value]) for label, value in constants]

        def nodes(p):
            inputs = [p + "q"] + [f"{p}i{j}" if s else "" for j, s in enumerate(sources)]
            return [
                h.make_node("Mul", [p + "x", p + "c60"], [p + "m"]),
                h.make_node("Add", [p + "m", p + "c128"], [p + "a"]),
                h.make_node("Clip", [p + "a", p + "c0", p + "c255"], [p + "c"]),
                h.make_node("Cast", [p + "c"], [p + "q"], to=self.tp.UINT8),
                h.make_node("MatMulIntegerToFloat", inputs, [p + "y"], domain="com.microsoft"),
            ]

        self._row_kernel(name, k, nodes, inits, self.tp.FLOAT)

    def norms(self, node) -> None:
        """SkipSimplifiedLayerNormalization at the graph's width, with the other row-wise kernels of a layer at that
        width: SimplifiedLayerNormalization (the first layer's norm) and SiLU (fused into QuickGelu)."""
        gamma = self.inits.get(node.input[2]) if len(node.input) > 2 else None
        if gamma is None:
            return
        width = int(gamma.dims[-1])
        name = f"SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization / SiLU {width}"
        if name in self.kernels:
            return
        eps = self.attrs(node).get("epsilon", 1e-5)
        p = f"k{len(self.kernels)}_"
        h = self.h
        nodes = [
            h.make_node("SkipSimplifiedLayerNormalization", [p + "x", p + "s", p + "g"], [p + "y", "", "", p + "t"],
                        domain="com.microsoft", epsilon=eps),
            h.make_node("SimplifiedLayerNormalization", [p + "x", p + "g"], [p + "n"], epsilon=eps),
            h.make_node("Sigmoid", [p + "x"], [p + "sig"]),
            h.make_node("Mul", [p + "x", p + "sig"], [p + "silu"]),
        ]  # fmt: skip
        x, s = (
            _rows_of(len(self.kernels), width, self.max_rows),
            _rows_of(len(self.kernels) + 1000, width, self.max_rows),
        )
        gamma = _random_initializer(h, p + "g", gamma, self.rng)
        inputs = [h.make_tensor_value_info(n, self.tp.FLOAT, [1, "rows", width]) for n in (p + "x", p + "s")]
        self.kernels[name] = Kernel(
            name, nodes, [gamma], inputs, {p + "y": 1, p + "t": 1, p + "n": 1, p + "silu": 1},
            lambda rows, past: {p + "x": x[:, :rows], p + "s": s[:, :rows]},
        )  # fmt: skip

    def attention(self, node) -> None:
        """GroupQueryAttention with the node's attributes and optional inputs; random cache and rotary tables."""
        h, tp, attrs = self.h, self.tp, self.attrs(node)
        used = [i for i, source in enumerate(node.input) if source]
        past = self.graph_inputs.get(node.input[3]) if len(node.input) > 3 else None
        dims = past.type.tensor_type.shape.dim if past is not None else []
        head_dim = dims[3].dim_value if len(dims) == 4 else 0
        heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        window = int(attrs.get("local_window_size", -1))
        int8 = past is not None and past.type.tensor_type.elem_type == tp.INT8  # builder/quantize/kv_int8.py
        name = f"GroupQueryAttention {heads}/{kv_heads} heads x {head_dim}" + "".join(
            label for index, label in ((9, " positions"), (10, " bias")) if index in used
        ) + (f" window {window}" if window > 0 else "") + (" int8 cache" if int8 else "")  # fmt: skip
        # packed qkv, caches, lengths, rotary tables, positions, bias, an int8 cache's scales
        supported = {0, 3, 4, 5, 6, 7, 8, 9, 10, 16} | ({12, 13} if int8 else set())
        if not head_dim or not set(used) <= supported or not {0, 3, 4, 5, 6, 7, 8} <= set(used):
            name += f" (inputs {used}: not probed)"
            self.kernels[name] = Kernel(name, [], [], [], {}, lambda rows, past: {}, attention=True)
            return
        if name in self.kernels:
            return
        p = f"k{len(self.kernels)}_"
        capacity = max(PASTS) + self.max_rows + 1
        width = (heads + 2 * kv_heads) * head_dim
        angles = np.random.default_rng(7).uniform(0, 6.3, size=(capacity, head_dim // 2)).astype(np.float32)
        inits = [
            h.make_tensor(p + "cos", tp.FLOAT, list(angles.shape), np.cos(angles).tobytes(), raw=True),
            h.make_tensor(p + "sin", tp.FLOAT, list(angles.shape), np.sin(angles).tobytes(), raw=True),
        ]
        slots = {0: "qkv", 3: "pk", 4: "pv", 5: "sk", 6: "tot", 7: "cos", 8: "sin", 9: "pos", 10: "bias", 12: "ks",
                 13: "vs", 16: "ql"}  # fmt: skip
        cache_type = tp.INT8 if int8 else tp.FLOAT
        if int8:
            inits += [h.make_tensor(p + s, tp.FLOAT, [1], [INT8_CACHE_SCALE]) for s in ("ks", "vs")]
        infos = {
            "qkv": (tp.FLOAT, [1, "rows", width]), "pk": (cache_type, [1, kv_heads, capacity, head_dim]),
            "pv": (cache_type, [1, kv_heads, capacity, head_dim]), "sk": (tp.INT32, [1]), "tot": (tp.INT32, []),
            "pos": (tp.INT64, [1, "rows"]), "bias": (tp.FLOAT, [1, 1, "rows", capacity]), "ql": (tp.INT32, [1]),
        }  # fmt: skip
        fed = [slots[i] for i in used if slots[i] in infos]
        inputs = [h.make_tensor_value_info(p + s, *infos[s]) for s in fed]
        node_inputs = [p + slots[i] if i in used else "" for i in range(max(used) + 1)]
        nodes = [h.make_node("GroupQueryAttention", node_inputs, [p + "o", p + "k", p + "v"], domain="com.microsoft",
                             **attrs)]  # fmt: skip
        rng = np.random.default_rng(11)
        qkv = rng.standard_normal((1, self.max_rows, width)).astype(np.float32)
        cache = rng.standard_normal((2, 1, kv_heads, capacity, head_dim)).astype(np.float32)
        if int8:
            cache = np.clip(np.rint(cache / INT8_CACHE_SCALE), -128, 127).astype(np.int8)

        def feeds(rows: int, past: int) -> dict:
            bias = np.full((1, 1, rows, capacity), -np.inf, dtype=np.float32)
            for r in range(rows):
                bias[0, 0, r, : past + r + 1] = 0
            values = {
                "qkv": qkv[:, :rows], "pk": cache[0].copy(), "pv": cache[1].copy(),
                "sk": np.array([past + rows - 1], np.int32), "tot": np.array(capacity, np.int32),
                "pos": np.arange(past, past + rows, dtype=np.int64)[None], "bias": bias,
                "ql": np.array([rows], np.int32),
            }  # fmt: skip
            return {p + s: values[s] for s in fed}

        outputs = {p + "o": 1, p + "k": "slots", p + "v": "slots"}
        self.kernels[name] = Kernel(name, nodes, inits, inputs, outputs, feeds, attention=True)


# ------------------------------------------------------------------------------------------------------ the probe
def _session(kernels: list[Kernel], opsets, ir_version: int, threads, accuracy_level: int):
    import onnxruntime as ort
    from onnx import ValueInfoProto, helper

    from specbuild.runtime.backends.onnxruntime import session_options

    outputs = [ValueInfoProto(name=name) for k in kernels for name in k.outputs]  # types inferred
    graph = helper.make_graph(
        [n for k in kernels for n in k.nodes],
        "row_invariance_probe",
        [i for k in kernels for i in k.inputs],
        outputs,
        [t for k in kernels for t in k.initializers],
    )
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    options = session_options(threads, accuracy_level)
    if own_kernels.library() is not None:  # the kernels the engine runs on (as kernels.wanted: every int4 matmul)
        from specbuild.runtime.kernels.rewrite import FLOAT, INT8, use_kernels

        matmuls = INT8 if accuracy_level == ef.ACCURACY_INT8 else FLOAT
        if use_kernels(model, matmuls=matmuls, attention=True):
            own_kernels.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _rows_from(kernel: Kernel, calls: dict[int, dict], past: int) -> int | None:
    """The smallest M such that every call of M rows or more gives each row the bits of the longest call;
    None when a call of several rows already disagrees with it."""

    def agrees(rows: int) -> bool:
        for name, axis in kernel.outputs.items():
            got, want = calls[rows][name], calls[longest][name]
            if axis == "slots":
                got, want = got[:, :, past : past + rows], want[:, :, past : past + rows]
            else:
                want = want.take(range(rows), axis=axis)
            if not np.array_equal(got, want):
                return False
        return True

    counts = sorted(calls)
    longest = counts[-1]
    index = len(counts) - 1
    while index > 0 and agrees(counts[index - 1]):
        index -= 1
    return None if counts[index] == longest else counts[index]


def probe_rows(max_rows: int) -> list[int]:
    """The row counts probed: every count up to DENSE_ROWS, then x1.5 steps up to max_rows (batched calls hold
    sequences x tokens rows)."""
    counts = list(range(1, min(max_rows, DENSE_ROWS) + 1))
    while counts[-1] < max_rows:
        counts.append(min(max_rows, counts[-1] * 3 // 2))
    return counts


def probe_model(model, threads: int | None, accuracy_level: int, max_rows: int = MAX_PROBE_ROWS) -> Verdict:
    """Measure every kernel configuration of `model` (an engine graph's onnx.ModelProto) on this machine, on calls
    of 1..max_rows rows (probe_rows)."""
    from onnx import helper

    started = time.perf_counter()
    kernels = list(_Collector(model, max_rows).kernels.values())
    opsets = [helper.make_opsetid(o.domain, o.version) for o in model.opset_import]
    if not any(o.domain == "com.microsoft" for o in opsets):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    results: dict[str, int | None] = {k.name: None for k in kernels if not k.nodes}  # not probed: not verified
    for group, pasts in (([k for k in kernels if k.nodes and not k.attention], PASTS[:1]),
                         ([k for k in kernels if k.nodes and k.attention], PASTS)):  # fmt: skip
        if not group:
            continue
        session = _session(group, opsets, model.ir_version, threads, accuracy_level)
        names = [name for k in group for name in k.outputs]
        for past in pasts:
            calls = {}
            for rows in probe_rows(max_rows):
                feeds = {name: value for k in group for name, value in k.feeds(rows, past).items()}
                calls[rows] = dict(zip(names, session.run(names, feeds)))
            for kernel in group:
                found = _rows_from(kernel, calls, past)
                before = results.get(kernel.name, 1)
                results[kernel.name] = None if found is None or before is None else max(found, before)
    return Verdict(results, cpu_description(), round(time.perf_counter() - started, 3))


def _step_rows(name: str, rows: int | None, attention_pad: int) -> int | None:
    """The step padding a kernel needs: its rows_from, except for attention within the graph's attention padding."""
    attention = name.startswith("GroupQueryAttention")
    return 1 if attention and rows is not None and rows <= attention_pad + 1 else rows


def blocking(kernels: dict[str, int | None], attention_pad: int, max_min_rows: int) -> list[str]:
    """The kernels no step padding up to max_min_rows makes exact."""
    needs = {name: _step_rows(name, rows, attention_pad) for name, rows in kernels.items()}
    return [name for name, rows in needs.items() if rows is None or rows > max_min_rows]


def engine_min_rows(kernels: dict[str, int | None], attention_pad: int, max_min_rows: int) -> int | None:
    """The step padding that makes every kernel exact; None when some kernel needs more than max_min_rows."""
    if blocking(kernels, attention_pad, max_min_rows):
        return None
    return max((_step_rows(name, rows, attention_pad) for name, rows in kernels.items()), default=1)


def check_graph(
    graph_file: Path,
    graph_sha256: str,
    threads: int | None,
    accuracy_level: int,
    attention_pad: int,
    max_min_rows: int,
    max_rows: int = MAX_PROBE_ROWS,
) -> Verdict:
    """The verdict for an engine graph on this machine: kept in the user cache, else measured (and kept). max_rows:
    the most rows an engine call may hold (at least MAX_PROBE_ROWS are probed)."""
    import onnxruntime as ort

    max_rows = max(max_rows, MAX_PROBE_ROWS)
    key = f"{PROBE_VERSION}|{graph_sha256}|{cpu_key()}|{ort.__version__}|{threads or 0}|{accuracy_level}|{max_rows}"
    key += f"|{own_kernels.tag()}"
    kept = user_cache.get(CACHE_NAME, key)
    if isinstance(kept, dict) and isinstance(kept.get("kernels"), dict):
        kernels = {str(k): v if type(v) is int else None for k, v in kept["kernels"].items()}
        verdict = Verdict(kernels, str(kept.get("cpu", "")), float(kept.get("seconds", 0.0)), cached=True)
    else:
        import onnx

        model = onnx.load(str(graph_file), load_external_data=False)
        verdict = probe_model(model, threads, accuracy_level, max_rows)
        user_cache.put(CACHE_NAME, key, {"kernels": verdict.kernels, "cpu": verdict.cpu, "seconds": verdict.seconds})
    verdict.min_rows = engine_min_rows(verdict.kernels, attention_pad, max_min_rows)
    return verdict
