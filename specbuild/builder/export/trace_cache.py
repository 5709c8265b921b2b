"""Exported step graphs kept by what their trace depends on: a build whose step module has the structure of an
earlier one (the same mode and settings on the same architecture, other weights: heads retrained, a fine-tuned
base, another seed) skips torch.export, the bulk of a small model's build.

The exporter traces the step module with every parameter and buffer fake (torch.export lifts them to graph inputs),
so the translated graph depends on the code, on the modules' Python attributes (config, tree, settings), on the
parameters' and buffers' names, shapes and dtypes and on the example inputs' shapes, never on a weight's value.
`fingerprint` hashes exactly those (but a module's `untraced_attributes`, which say where its weights come from);
an attribute of a type it cannot hash makes the module uncacheable (the export then runs as always).

An entry is the translated model before the fake weights get their lazy values and before the optimizer folds
anything, each parameter and buffer kept as a reference without data; `take` gives each the current module's
tensor. A fresh trace is kept and taken back the same way before it is used, so an engine's files are the same
bytes whether its trace was cached or not. Entries live in this process and, with $SPECBUILD_TRACE_CACHE set to a
directory, on disk; the key hashes specbuild's own source files and the exporter's versions, so a changed specbuild,
torch, onnxscript or onnx_ir never reads an old trace.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import types
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

CACHE_ENV = "SPECBUILD_TRACE_CACHE"
STATE_LOCATION = "specbuild-module-state"  # where an entry says a parameter's or buffer's data is
_MEMORY: dict[str, bytes] = {}  # key -> the serialized model without weight data
_MODULE_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
_source_digest: str | None = None


class Uncacheable(Exception):
    """The module holds something fingerprint cannot hash: its trace is not cached."""


def fingerprint(step: torch.nn.Module, args, extra: tuple) -> str:
    """The key of `step`'s trace with example inputs `args` (their shapes and dtypes) and `extra` (the export's
    other settings: names, dynamic shapes, opset). Raises Uncacheable."""
    digest = hashlib.sha256(_sources().encode())
    digest.update(_canon(extra).encode())
    digest.update(_canon([_tensor_spec(a) if isinstance(a, torch.Tensor) else a for a in _flat(args)]).encode())
    paths = {id(module): name for name, module in step.named_modules()}  # a module an attribute refers to: by its path
    for name, module in step.named_modules(remove_duplicate=False):
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__}".encode())
        untraced = _MODULE_STATE | set(getattr(type(module), "untraced_attributes", ()))
        for key, value in sorted(vars(module).items()):
            if key in untraced:
                continue
            if "hook" in key:  # torch's hook tables: empty, or the module is not cached
                if value:
                    raise Uncacheable(f"{name}.{key}: hooks")
                continue
            digest.update(f"{key}={_canon(value, paths)}".encode())
        for kind, tensors in (("p", module._parameters), ("b", module._buffers)):
            for key, tensor in tensors.items():
                digest.update(f"{kind}:{key}:{None if tensor is None else _tensor_spec(tensor)}".encode())
    return digest.hexdigest()


def take(key: str, step: torch.nn.Module) -> ir.Model | None:
    """The model cached under `key`, its parameters and buffers given `step`'s tensors, or None."""
    import onnx
    from torch.onnx._internal.exporter._core import TorchTensor  # what the exporter wraps a module's tensor in

    data = _MEMORY.get(key)
    if data is None and (folder := _folder()) is not None and (folder / f"{key}.onnx").is_file():
        data = _MEMORY[key] = (folder / f"{key}.onnx").read_bytes()
    if data is None:
        return None
    model = ir.serde.deserialize_model(onnx.ModelProto.FromString(data))
    state = _state(step)
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and tensor.location == STATE_LOCATION:
            if name not in state:  # the trace of another module after all
                return None
            value.const_value = TorchTensor(state[name], name=name)
    return model


def keep(key: str, model: ir.Model, step: torch.nn.Module) -> None:
    """Cache `model`, just translated from `step`'s trace, under `key`: each initializer that is one of `step`'s
    parameters or buffers as a reference to it (STATE_LOCATION) without its data. `model` itself is left as it was."""
    state = _state(step)
    kept = {}
    for name, value in model.graph.initializers.items():
        if name in state and value.const_value is not None:
            kept[name] = tensor = value.const_value
            reference = ir.ExternalTensor(STATE_LOCATION, None, None, tensor.dtype, shape=tensor.shape, name=name)
            value.const_value = reference
    try:
        data = ir.serde.serialize_model(model).SerializeToString()
    finally:
        for name, tensor in kept.items():
            model.graph.initializers[name].const_value = tensor
    _MEMORY[key] = data
    if (folder := _folder()) is not None:
        folder.mkdir(parents=True, exist_ok=True)
        staged = folder / f".{key}.{os.getpid()}.tmp"  # whole or not at all: builds in parallel share the folder
        staged.write_bytes(data)
        staged.replace(folder / f"{key}.onnx")


def _state(step: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by the names the exporter gives their initializers."""
    return {**dict(step.named_parameters()), **dict(step.named_buffers())}


def _folder() -> Path | None:
    path = os.environ.get(CACHE_ENV)
    return Path(path) if path else None


def _sources() -> str:
    """sha256 of specbuild's Python files and the exporter's versions (once per process)."""
    global _source_digest
    if _source_digest is None:
        import onnxscript

        root = Path(__file__).resolve().parents[2]  # specbuild/
        digest = hashlib.sha256(f"{torch.__version__} {onnxscript.__version__} {ir.__version__}".encode())
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        _source_digest = digest.hexdigest()
    return _source_digest


def _flat(args) -> list:
    out = []
    for a in args:
        out += _flat(a) if isinstance(a, (tuple, list)) else [a]
    return out


def _tensor_spec(tensor: torch.Tensor) -> tuple:
    from torch._subclasses.fake_tensor import FakeTensor

    return (tuple(tensor.shape), str(tensor.dtype), isinstance(tensor, FakeTensor) or tensor.is_meta)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canon(value, paths: dict[int, str] | None = None) -> str:
    """A text that is equal for equal values of the types a step module's attributes hold (a module of the step
    module, in `paths`, by its path); Uncacheable otherwise."""
    canon = functools.partial(_canon, paths=paths)
    if isinstance(value, torch.nn.Module):
        if paths is None or id(value) not in paths:
            raise Uncacheable(f"an attribute holding a module of type {type(value).__qualname__} outside the step")
        return f"module:{paths[id(value)]}"
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.generic)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (torch.dtype, torch.device, enum.Enum)):
        return f"{type(value).__name__}:{value}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}[{','.join(canon(v) for v in value)}]"
    if isinstance(value, (set, frozenset)):
        return f"set[{','.join(sorted(canon(v) for v in value))}]"
    if isinstance(value, dict):
        return f"dict[{','.join(sorted(f'{canon(k)}:{canon(v)}' for k, v in value.items()))}]"
    if isinstance(value, np.ndarray):
        return f"ndarray:{value.dtype}:{value.shape}:{_digest(np.ascontiguousarray(value).tobytes())}"
    if isinstance(value, torch.Tensor):  # a plain tensor attribute: a constant the trace may bake in
        spec = _tensor_spec(value)
        if spec[2]:
            raise Uncacheable("a fake tensor attribute")
        data = value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b""
        return f"tensor:{spec}:{_digest(data)}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)) and "<" not in value.__qualname__:
        return f"function:{value.__module__}.{value.__qualname__}"  # a module's function (not a closure)
    if isinstance(value, functools.partial):
        return f"partial({canon(value.func)},{canon(value.args)},{canon(value.keywords)})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={canon(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    raise Uncacheable(f"an attribute of type {type(value).__qualname__}")
