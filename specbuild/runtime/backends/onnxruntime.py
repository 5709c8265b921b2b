"""ONNX Runtime backend (CPU) with IOBinding: inputs are bound from the runtime's numpy buffers without copies."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specbuild import engine_format as ef
from specbuild.runtime import kernels
from specbuild.runtime.backends.base import Backend


def session_options(threads: int = 0, accuracy_level: int = 1, spinning: bool = True):
    """threads: intra-op threads, resolved (base.resolve_threads; 0 = ONNX Runtime's default). spinning: the pool's
    threads busy-wait for work after a call (the fastest for one session, and for a target whose draft model runs
    between its calls; the draft's session runs without: two spinning pools steal each other's cores)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
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


SCRATCH_MAX_ELEMENTS = 4096  # per-step inputs up to this size are copied into buffers bound once


class Outputs(dict):
    """A call's outputs by name. The aliased ones (long-lived buffers, written in place) are found on access rather
    than copied into every call's dict: iteration lists the others only."""

    __slots__ = ("aliased",)

    def __init__(self, plain: dict, aliased: dict):
        super().__init__(plain)
        self.aliased = aliased

    def __missing__(self, name):
        return self.aliased[name]

    def __contains__(self, name) -> bool:
        return dict.__contains__(self, name) or name in self.aliased

    def get(self, name, default=None):
        return self[name] if name in self else default


class Binding:
    """One IOBinding kept across calls, so that a decode step binds almost nothing:

    - long-lived buffers (BoundArray: the KV cache) come as their own mapping (`buffers`), the same object for as
      long as its buffers stay the same: a call with the mapping of the last call binds and reads none of them; a
      new one (the cache grew) binds what changed, and the outputs aliased to it are bound in place again;
    - small per-step inputs (token ids, positions, sampling scalars, random draws) are copied into buffers of the
      binding's own, bound once per shape, instead of a new OrtValue per input per call;
    - larger plain inputs (a prompt's mask, mode state caches) are bound without a copy on every call.
    The other outputs (accepted tokens, next tree, ...) are allocated by the session on every call: their shapes
    may depend on values, and a pre-allocated output of the wrong shape fails the call after in-place updates ran."""

    def __init__(self, session, output_names, input_names=None):
        import onnxruntime as ort

        self.session = session
        self.output_names = list(output_names)
        self.input_names = set(input_names) if input_names is not None else {i.name for i in session.get_inputs()}
        self.binding = session.io_binding()
        self._ort = ort
        self._cpu = ort.OrtDevice.make("cpu", 0)._get_c_device()  # made once: bind_output's wrapper makes one per call
        self.bound: dict[str, object] = {}  # input name -> the BoundArray bound to it (the caller's or a scratch one)
        self._scratch: dict[str, BoundArray] = {}  # input name -> the binding's own copy buffer
        self._buffers = None  # the `buffers` mapping of the last call
        self._buffer_values: dict[str, BoundArray] = {}  # its buffers, by input name
        self._buffer_arrays: dict[str, np.ndarray] = {}  # and their arrays
        self._aliases = None  # the aliases the outputs are bound for (None: bind them again on the next call)
        self._sources: tuple = (None, frozenset())  # (aliases, the input names they read): made once per aliases
        self._plain_outputs: list[tuple[int, str]] = []  # (index in the graph's outputs, name): not aliased
        self._alias_outputs: list[tuple[str, str]] = []  # (output, input) sharing the input's buffer
        self._alias_values: dict[str, np.ndarray] = {}  # aliased output -> its (long-lived) buffer, when in place

    def run(self, feeds: dict, aliases: dict[str, str] | None = None, buffers: dict | None = None):
        """Returns ({output name: array}, seconds inside the session); aliased outputs are their input's array.

        buffers: input name -> BoundArray, long-lived (pass the same mapping object while its buffers are the same)."""
        aliases = aliases or {}
        rebind_outputs = self._aliases is not aliases
        if self._sources[0] is not aliases:
            self._sources = (aliases, frozenset(aliases.values()))
        sources = self._sources[1]
        inputs, bound, scratch_of = self.input_names, self.bound, self._scratch
        if buffers is not self._buffers:
            self._buffers, self._buffer_values, self._buffer_arrays = buffers, {}, {}
            for name, value in (buffers or {}).items():
                if name in inputs:
                    if type(value) is not BoundArray:  # a plain array: wrapped once per mapping
                        value = BoundArray(value)
                    self._buffer_values[name] = value
                    self._buffer_arrays[name] = value.array
                    if bound.get(name) is not value:
                        self.binding.bind_ortvalue_input(name, value.ortvalue)
                        bound[name] = value
                        rebind_outputs = True
        arrays = {}
        for name, value in feeds.items():
            if name not in inputs:
                continue
            if type(value) is BoundArray:
                arrays[name] = value.array
                if bound.get(name) is not value:
                    self.binding.bind_ortvalue_input(name, value.ortvalue)
                    bound[name] = value
                    rebind_outputs = True
                continue
            scratch = scratch_of.get(name)
            if (
                scratch is not None
                and bound.get(name) is scratch
                and scratch.array.shape == value.shape
                and scratch.array.dtype == value.dtype
            ):
                np.copyto(scratch.array, value)
                arrays[name] = scratch.array
            elif value.size <= SCRATCH_MAX_ELEMENTS and name not in sources:
                scratch = scratch_of[name] = BoundArray(np.array(value, order="C"))
                self.binding.bind_ortvalue_input(name, scratch.ortvalue)
                bound[name] = scratch
                arrays[name] = scratch.array
            else:  # bound without a copy, on every call
                array = value if value.flags.c_contiguous else np.ascontiguousarray(value)
                arrays[name] = array
                self.binding.bind_ortvalue_input(name, self._ort.OrtValue.ortvalue_from_numpy(array))
                bound.pop(name, None)
                rebind_outputs = rebind_outputs or name in sources
        if rebind_outputs:
            self._bind_outputs({**self._buffer_values, **feeds}, aliases, {**self._buffer_arrays, **arrays})
        else:
            bind_output, cpu = self.binding._iobinding.bind_output, self._cpu
            for _, name in self._plain_outputs:  # unallocated again: the session allocates them on every call
                bind_output(name, cpu)
        start = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        elapsed = time.perf_counter() - start
        values = self.binding._iobinding.get_outputs()  # the raw vector: no Python wrapper per (aliased) output
        plain = {name: values[index].numpy() for index, name in self._plain_outputs}
        if self._aliases is not None:  # bound in place: the aliased outputs are the long-lived buffers
            return Outputs(plain, self._alias_values), elapsed
        if self._buffer_arrays:
            arrays = {**self._buffer_arrays, **arrays}
        return Outputs(plain, {name: arrays[source] for name, source in self._alias_outputs}), elapsed

    def _bind_outputs(self, feeds: dict, aliases: dict[str, str], arrays: dict) -> None:
        """Bind every output again, in the graph's order (get_outputs follows it): aliased ones onto their input's
        buffer, the others to be allocated by the session."""
        self.binding.clear_binding_outputs()
        self._plain_outputs, self._alias_outputs, self._alias_values = [], [], {}
        in_place = True  # every aliased input is a long-lived BoundArray: no need to bind again next call
        for index, name in enumerate(self.output_names):
            source = aliases.get(name)
            if source is not None and source in arrays:
                value = feeds[source]
                if type(value) is not BoundArray:
                    value, in_place = BoundArray(arrays[source]), False
                self.binding.bind_ortvalue_output(name, value.ortvalue)
                self._alias_outputs.append((name, source))
                self._alias_values[name] = value.array
            else:
                self.binding._iobinding.bind_output(name, self._cpu)
                self._plain_outputs.append((index, name))
        self._aliases = aliases if in_place else None


def run_bound(session, feeds: dict, output_names, aliases: dict[str, str] | None = None):
    """One call with a fresh Binding (build-time validation); see Binding.run."""
    return Binding(session, output_names).run(feeds, aliases)


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, engine_dir: Path, manifest: dict, graph: dict, threads: int = 0, shared_cores: bool = False):
        import onnxruntime as ort

        super().__init__(engine_dir, manifest, graph, threads, shared_cores)
        path = self.engine_dir / graph["file"]
        level = (graph.get("quantization") or {}).get("accuracy_level", ef.ACCURACY_FLOAT32)
        options = session_options(threads, level, spinning=not shared_cores)
        source = kernels.session_source(path, options, graph)  # the graph on specbuild's kernels where they serve
        self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = {i.name for i in self.session.get_inputs()}
        self._binding = None

    def graph_metadata(self) -> dict[str, str]:
        """The graph file's metadata entries (what the build recorded inside it, e.g. the positions it addresses)."""
        return dict(self.session.get_modelmeta().custom_metadata_map)

    def bind(self, array: np.ndarray) -> BoundArray:
        """Wrap a buffer fed on every call (its OrtValue is made once)."""
        return BoundArray(array)

    def run(self, feeds: dict, aliases: dict[str, str] | None = None, buffers: dict | None = None) -> dict:
        if self._binding is None:
            self._binding = Binding(self.session, self.output_names, self.input_names)
        outputs, self.last_engine_s = self._binding.run(feeds, aliases, buffers)
        return outputs
