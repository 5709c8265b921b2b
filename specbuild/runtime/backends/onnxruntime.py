"""ONNX Runtime backend (CPU) with IOBinding: inputs are bound from the runtime's numpy buffers without copies."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from specbuild.runtime.backends.base import Backend


def session_options(threads: int | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    threads = threads or int(os.environ.get("SPECBUILD_THREADS", "0") or 0)
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return opts


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, engine_dir: Path, manifest: dict, threads: int | None = None):
        import onnxruntime as ort

        self._ort = ort
        path = Path(engine_dir) / manifest["files"]["onnx"]
        self.session = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.input_names = {i.name for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if name in self.input_names:
                binding.bind_ortvalue_input(name, self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value)))
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.last_engine_s = time.perf_counter() - start
        return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))
