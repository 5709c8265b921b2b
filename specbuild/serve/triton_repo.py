"""`specbuild triton-repo`: a Triton model repository serving an engine on Triton's Python backend.

It writes `<output-dir>/<model>/config.pbtxt` (backend "python", no Triton batching -- the scheduler batches --,
decoupled transaction policy for streaming, the inputs and outputs of triton_io.py, the engine directory and runtime
options as parameters) and `<model>/1/model.py`, which imports the model from specbuild.serve.triton_backend: the
Python that Triton runs must have specbuild installed (`pip install specbuild[serve]`). The model directory is
written atomically (nothing partial is left); other models in the repository are left alone.
"""

from __future__ import annotations

from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.fsutil import atomic_output_dir
from specbuild.runtime.manifest import load_manifest
from specbuild.serve import triton_io

MODEL_PY = '''"""Triton Python-backend model written by `specbuild triton-repo`: the engine named in config.pbtxt,
served by specbuild's scheduler as a decoupled streaming model (specbuild/serve/triton_backend.py)."""

from specbuild.serve.triton_backend import TritonPythonModel  # noqa: F401
'''


def config_pbtxt(name: str, parameters: dict[str, str]) -> str:
    """The model's config.pbtxt (Triton's protobuf text format)."""

    def tensor(spec: triton_io.TensorSpec) -> str:
        dims = ", ".join(str(d) for d in spec.shape)
        optional = " optional: true" if spec.optional else ""
        return f'  {{ name: "{spec.name}" data_type: {spec.triton_type} dims: [ {dims} ]{optional} }}'

    lines = [
        f'name: "{name}"',
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
    ]
    lines += ["input [", ",\n".join(tensor(s) for s in triton_io.INPUTS), "]"]
    lines += ["output [", ",\n".join(tensor(s) for s in triton_io.OUTPUTS), "]"]
    lines += ["instance_group [ { count: 1 kind: KIND_CPU } ]"]
    for key, value in parameters.items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{_escape(value)}" }} }}')
    return "\n".join(lines) + "\n"


def write_repository(
    engine_dir, output_dir, model_name: str | None = None, threads: int | None = None,
    max_batch_size: int | None = None, overwrite: bool = False,
) -> Path:  # fmt: skip
    """Write the model directory into the repository `output_dir`; returns its path."""
    engine_dir = Path(engine_dir).resolve()
    limits = load_manifest(engine_dir)["limits"]  # a clear error when it is not an engine
    if threads is not None and threads < 1:
        raise SpecbuildError(f"--threads must be an integer >= 1, got {threads}")
    if max_batch_size is not None and not 1 <= max_batch_size <= limits["max_batch_size"]:
        raise SpecbuildError(
            f"--max-batch-size {max_batch_size} is outside [1, {limits['max_batch_size']}] (the engine's KV slots)"
        )
    name = triton_io.check_model_name(model_name or engine_dir.name)
    parameters = {"engine_dir": str(engine_dir)}
    if threads is not None:
        parameters["threads"] = str(threads)
    if max_batch_size is not None:
        parameters["max_batch_size"] = str(max_batch_size)
    model_dir = Path(output_dir) / name
    with atomic_output_dir(model_dir, overwrite=overwrite, inputs=[engine_dir], mark=True) as tmp:
        (tmp / "config.pbtxt").write_text(config_pbtxt(name, parameters))
        (tmp / "1").mkdir()
        (tmp / "1" / "model.py").write_text(MODEL_PY)
    return model_dir


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
