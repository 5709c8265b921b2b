"""ONNX Runtime backend (CPU) with IOBinding: inputs are bound from the runtime's numpy buffers without copies."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from specbuild.runtime.backends.base import Backend


def session_options(threads: int | None = None, accuracy_level: int = 1):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    threads = threads or int(os.environ.get("SPECBUILD_THREADS", "0") or 0)
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # int4 graphs hold DequantizeLinear -> MatMul pairs that ONNX Runtime fuses into MatMulNBits at load, at the
    # accuracy level the build validated (engine.yaml graphs[].quantization; 1 = float32 activations)
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy_level))
    return opts


class BoundArray:
    """A numpy buffer with its OrtValue (sharing its memory), for inputs fed on every call (the KV cache)."""

    __slots__ = ("array", "ortvalue")

    def __init__(self, array: np.ndarray):
        import onnxruntime as ort

        self.array = array
        self.ortvalue = ort.OrtValue.ortvalue_from_numpy(array)


class Binding:
    """One IOBinding kept across calls: long-lived buffers (BoundArray) and the outputs aliased to them are bound
    again only when a buffer changes (the KV cache grows); the small per-step inputs and the other outputs are
    bound on every call."""

    def __init__(self, session, output_names):
        self.session = session
        self.output_names = list(output_names)
        self.binding = session.io_binding()
        self.bound: dict[str, object] = {}  # input name -> the BoundArray bound to it
        self._outputs = set(self.output_names)
        self._aliased: dict[str, object] = {}  # output name -> the BoundArray it is bound to (in place)

    def run(self, feeds: dict, aliases: dict[str, str] | None = None):
        """Returns ({output name: array}, seconds inside the session); aliased outputs are their input's array."""
        import onnxruntime as ort

        aliases = aliases or {}
        arrays = {}
        for name, value in feeds.items():
            if isinstance(value, BoundArray):
                arrays[name] = value.array
                if self.bound.get(name) is not value:
                    self.binding.bind_ortvalue_input(name, value.ortvalue)
                    self.bound[name] = value
            else:
                array = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                arrays[name] = array
                self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        targets = {name: feeds[source] for name, source in aliases.items() if name in self._outputs}
        if targets.keys() != self._aliased.keys() or any(targets[n] is not self._aliased[n] for n in targets):
            # first call, or a buffer changed: bind every output again, in the graph's order (get_outputs follows it)
            self.binding.clear_binding_outputs()
            for name in self.output_names:
                if name in targets:
                    source = targets[name]
                    value = (
                        source.ortvalue
                        if isinstance(source, BoundArray)
                        else BoundArray(arrays[aliases[name]]).ortvalue
                    )
                    self.binding.bind_ortvalue_output(name, value)
                else:
                    self.binding.bind_output(name, "cpu")
            self._aliased = targets if all(isinstance(v, BoundArray) for v in targets.values()) else {}
        else:
            for name in self.output_names:
                if name not in targets:  # unallocated again: these shapes change from call to call
                    self.binding.bind_output(name, "cpu")
        start = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        elapsed = time.perf_counter() - start
        values = self.binding._iobinding.get_outputs()  # the raw vector: no Python wrapper per (aliased) output
        outputs = {}
        for index, name in enumerate(self.output_names):  # bound in the graph's output order
            outputs[name] = arrays[aliases[name]] if name in aliases else values[index].numpy()
        return outputs, elapsed


def run_bound(session, feeds: dict, output_names, aliases: dict[str, str] | None = None):
    """One call with a fresh Binding (build-time validation); see Binding.run."""
    return Binding(session, output_names).run(feeds, aliases)


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, engine_dir: Path, graph: dict, threads: int | None = None):
        import onnxruntime as ort

        self._ort = ort
        path = Path(engine_dir) / graph["file"]
        level = int((graph.get("quantization") or {}).get("accuracy_level", 1))
        self.session = ort.InferenceSession(
            str(path), session_options(threads, level), providers=["CPUExecutionProvider"]
        )
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = {i.name for i in self.session.get_inputs()}
        self._binding = None

    @staticmethod
    def bind(array: np.ndarray) -> BoundArray:
        """Wrap a buffer fed on every call (its OrtValue is made once)."""
        return BoundArray(array)

    def run(self, feeds: dict[str, np.ndarray], aliases: dict[str, str] | None = None) -> dict[str, np.ndarray]:
        feeds = {k: v for k, v in feeds.items() if k in self.input_names}
        if self._binding is None:
            self._binding = Binding(self.session, self.output_names)
        outputs, self.last_engine_s = self._binding.run(feeds, aliases)
        return outputs
