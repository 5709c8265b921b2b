"""Read and check an engine directory's engine.yaml.

`SCHEMA` declares every field the runtime, `inspect` and `bench` read, with its type and range; a missing or
malformed field is one SpecbuildError naming its path (`engine/engine.yaml: field limits.max_seq_len is missing`).
A mode's drafter declares the fields it reads under `mode` the same way and checks them with `check_fields`.
Fields the schema does not name are ignored (room for additions). After the schema, the recorded file sizes are
checked (see runtime/integrity.py): a truncated, missing or resized engine file is refused before any session.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from specbuild import engine_format as ef
from specbuild.errors import SpecbuildError
from specbuild.runtime.integrity import HASH_ALGORITHM, check_sizes

ENGINE_DTYPES = ("float32", "float16")
STATE_DTYPES = ("float32", "float16", "int64", "bool")
# outputs the generation loop reads from every engine call (plus the KV outputs of the graph's layout)
REQUIRED_OUTPUTS = (ef.ACCEPTED_TOKENS, ef.NUM_ACCEPTED, ef.ACCEPTED_NODES, ef.NEXT_INPUT_IDS)


@dataclasses.dataclass(frozen=True)
class Check:
    """One field: `expected` describes it in the error message; `test` accepts a present, non-null value."""

    expected: str
    test: Callable[[Any], bool]
    optional: bool = False  # may be absent
    nullable: bool = False  # may be null


@dataclasses.dataclass(frozen=True)
class Fields:
    """A mapping whose keys follow `schema` (a plain dict schema, when it may be absent or null)."""

    schema: dict
    optional: bool = False
    nullable: bool = False


@dataclasses.dataclass(frozen=True)
class ListOf:
    """A list whose items all follow `item` (a Check or a mapping schema)."""

    item: Any
    optional: bool = False
    nullable: bool = False
    min_len: int = 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_file_name(v) -> bool:
    """A relative path inside the engine directory (no absolute path, no `..`)."""
    if not isinstance(v, str) or not v or "\\" in v:
        return False
    p = PurePosixPath(v)
    return not p.is_absolute() and ".." not in p.parts and p.name not in ("", ".")


def integer(lo: int, **kw) -> Check:
    return Check(f"an integer >= {lo}", lambda v: _is_int(v) and v >= lo, **kw)


def text(**kw) -> Check:
    return Check("a string", lambda v: isinstance(v, str), **kw)


def one_of(choices, **kw) -> Check:
    return Check(f"one of {', '.join(choices)}", lambda v: v in choices, **kw)


def number(**kw) -> Check:
    return Check("a number", _is_number, **kw)


def flag(**kw) -> Check:
    return Check("true or false", lambda v: isinstance(v, bool), **kw)


def mapping(**kw) -> Check:
    return Check("a mapping", lambda v: isinstance(v, dict), **kw)


def file_name(**kw) -> Check:
    return Check("a file name inside the engine directory", _is_file_name, **kw)


def _shape_dim(v) -> bool:
    return (_is_int(v) and v >= 0) or isinstance(v, str)


SHAPE = Check(
    "a list of dimensions (integers >= 0 or names)", lambda v: isinstance(v, list) and all(map(_shape_dim, v))
)
CHOICES = Check(
    "a list of choices (lists of integers >= 0)",
    lambda v: isinstance(v, list) and all(isinstance(c, list) and all(_is_int(i) and i >= 0 for i in c) for c in v),
)
SHA256 = Check("64 hex digits", lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None)
IO_ITEM = {"name": text(), "dtype": text(), "shape": SHAPE}
ACCURACY_LEVEL = Check(
    f"{ef.ACCURACY_FLOAT32} (float32 activations) or {ef.ACCURACY_INT8} (int8 activations)",
    lambda v: _is_int(v) and v in (ef.ACCURACY_FLOAT32, ef.ACCURACY_INT8),
    optional=True,
)

# Every field read by the runtime (engine.py, backends), inspect.py and bench/sequential.py. `format` and
# `format_version` are checked first, by load_manifest itself.
SCHEMA: dict[str, Any] = {
    "specbuild_version": text(optional=True),
    "speculative_mode": Check("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "dtype": one_of(ENGINE_DTYPES),
    "lossless": flag(optional=True),
    "lossy_reason": text(optional=True, nullable=True),
    ef.NEEDS_ORDERED_ATTENTION: flag(optional=True),
    "typical_acceptance": Check(
        "a list of two numbers (EPS, ALPHA)",
        lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_number, v)),
        optional=True,
        nullable=True,
    ),
    "model": {
        "vocab_size": integer(1),
        "num_layers": integer(1),
        "num_kv_heads": integer(1),
        "head_dim": integer(1),
        "eos_token_ids": ListOf(integer(0), optional=True, nullable=True),
    },
    "limits": {
        "max_seq_len": integer(2),
        "max_batch_size": integer(1, optional=True),
        "max_new_tokens_per_step": integer(1),
        ef.ROPE_SWITCH: integer(1, optional=True),
    },
    "sampling": mapping(optional=True, nullable=True),
    "tree": {
        "dynamic": flag(optional=True),
        # required unless dynamic (checked in _check_tree)
        "choices": dataclasses.replace(CHOICES, optional=True),
        "size": integer(1, optional=True),
        "depth": integer(0, optional=True),
    },
    "mode": mapping(optional=True, nullable=True),
    "states": ListOf(
        {
            "name": text(),
            "shape": Check(
                'a list of dimensions (integers >= 0, "B" or "C")',
                lambda v: isinstance(v, list) and all((_is_int(d) and d >= 0) or d in ("B", "C") for d in v),
            ),
            "dtype": one_of(STATE_DTYPES),
            "fill": number(optional=True),
            "grow_axis": integer(0, optional=True, nullable=True),
        },
        optional=True,
    ),
    "graphs": ListOf(
        {
            "role": one_of((ef.ROLE_TARGET, ef.ROLE_DRAFT)),
            "backend": one_of(ef.BACKENDS),
            "file": file_name(),
            "kv_cache": one_of((ef.KV_STACKED, ef.KV_SHARED)),
            "weights": one_of(ef.WEIGHTS),
            "attention_pad_rows": integer(0, optional=True),
            ef.GRAPH_KV_CACHE_DTYPE: one_of(ef.KV_CACHE_DTYPES, optional=True),
            "quantization": Fields(  # quantized graphs: MatMulNBits' activations, as the build validated them
                {"accuracy_level": ACCURACY_LEVEL},
                optional=True,
                nullable=True,
            ),
            "opset": integer(1, optional=True),  # of the default ONNX domain (18; 21 with int4 weights)
            "io": {"inputs": ListOf(IO_ITEM), "outputs": ListOf(IO_ITEM)},
        },
        min_len=1,
    ),
    "files": {
        "tokenizer": file_name(optional=True, nullable=True),
        "plan": file_name(optional=True, nullable=True),
    },
    "chat_template": text(optional=True, nullable=True),
    "validation": Check(
        "a mapping with numbers max_abs_diff and tolerance",
        lambda v: isinstance(v, dict) and all(_is_number(v.get(k)) for k in ("max_abs_diff", "tolerance")),
        optional=True,
        nullable=True,
    ),
    "weights": Check(
        "a mapping (mode_weights: the heads' and draft layers' weights, float32, float16, int8 or int4)",
        lambda v: (
            isinstance(v, dict) and v.get("mode_weights", ENGINE_DTYPES[0]) in ENGINE_DTYPES + ef.BLOCKWISE_WEIGHTS
        ),
        optional=True,
    ),
    "build_seconds": number(optional=True, nullable=True),
    "checksums": Check("a mapping of file name to {size, sha256}", lambda v: isinstance(v, dict) and bool(v)),
}
CHECKSUM_RECORD = {"size": integer(0), HASH_ALGORITHM: SHA256}


class _Invalid(Exception):
    pass


def _describe(value) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _validate(value, schema, path: str) -> None:
    """Raise _Invalid(message) at the first field that is missing or malformed (message names the field path)."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise _Invalid(f"field {path} must be a mapping, got {_describe(value)}")
        for key, sub in schema.items():
            sub_path = f"{path}.{key}" if path else key
            if key not in value:
                if not getattr(sub, "optional", False):
                    raise _Invalid(f"field {sub_path} is missing")
                continue
            _validate(value[key], sub, sub_path)
    elif isinstance(schema, Fields):
        if value is not None or not schema.nullable:
            _validate(value, schema.schema, path)
    elif isinstance(schema, ListOf):
        if value is None and schema.nullable:
            return
        if not isinstance(value, list):
            raise _Invalid(f"field {path} must be a list, got {_describe(value)}")
        if len(value) < schema.min_len:
            raise _Invalid(f"field {path} must have at least {schema.min_len} item(s)")
        for i, item in enumerate(value):
            _validate(item, schema.item, f"{path}[{i}]")
    elif value is None:
        if not schema.nullable:
            raise _Invalid(f"field {path} is null (must be {schema.expected})")
    elif not schema.test(value):
        raise _Invalid(f"field {path} must be {schema.expected}, got {_describe(value)}")


def _check_semantics(manifest: dict) -> None:
    """Cross-field rules the per-field schema cannot say."""
    tree = manifest["tree"]
    if not tree.get("dynamic"):
        for key in ("choices", "size", "depth"):
            if key not in tree:
                raise _Invalid(f"field tree.{key} is missing (the tree is not dynamic)")
    for i, spec in enumerate(manifest.get("states") or []):
        axis = spec.get("grow_axis")
        if axis is not None and axis >= len(spec["shape"]):
            raise _Invalid(f"field states[{i}].grow_axis {axis} is outside its shape {spec['shape']}")
    num_layers = manifest["model"]["num_layers"]
    for i, graph in enumerate(manifest["graphs"]):
        if graph["role"] != ef.ROLE_TARGET:
            continue  # a draft model's graph: its own engine.yaml (in its directory) describes and checks it
        outputs = {o["name"] for o in graph["io"]["outputs"]}
        if graph["kv_cache"] == ef.KV_STACKED:
            required = [*REQUIRED_OUTPUTS, ef.NEW_KV]
        else:
            required = [*REQUIRED_OUTPUTS] + [
                name.format(layer) for layer in range(num_layers) for name in (ef.PRESENT_KEY, ef.PRESENT_VALUE)
            ]
        missing = [name for name in required if name not in outputs]
        if missing:
            raise _Invalid(f"field graphs[{i}].io.outputs lacks {', '.join(missing[:3])}")
    records = manifest["checksums"]
    for i, graph in enumerate(manifest["graphs"]):
        if graph["file"] not in records:
            raise _Invalid(f"field graphs[{i}].file names {graph['file']}, which field checksums does not record")
    for name, record in records.items():
        if not _is_file_name(name):
            raise _Invalid(f"field checksums has an invalid file name {_describe(name)}")
        _validate(record, CHECKSUM_RECORD, f"checksums[{name}]")
    for key in ("tokenizer", "plan"):
        name = manifest["files"].get(key)
        if name and name not in records:
            raise _Invalid(f"field files.{key} names {name}, which field checksums does not record")


def check_fields(manifest: dict, schema: dict, file) -> None:
    """Check the fields a part of the runtime declares beyond SCHEMA (e.g. a drafter's settings under `mode`)."""
    try:
        _validate(manifest, schema, "")
    except _Invalid as exc:
        raise SpecbuildError(f"{file}: {exc}") from None


def validate_manifest(manifest: Any, file) -> dict:
    """Check a parsed engine.yaml against SCHEMA; return it, or raise one SpecbuildError naming the bad field."""
    if not isinstance(manifest, dict):
        raise SpecbuildError(f"{file}: not a specbuild engine manifest (expected a mapping)")
    if "format" not in manifest:
        raise SpecbuildError(f"{file}: field format is missing (not a specbuild engine manifest)")
    if manifest["format"] != ef.ENGINE_FORMAT:
        raise SpecbuildError(f"{file}: not a specbuild engine manifest (format {_describe(manifest['format'])})")
    if "format_version" not in manifest:
        raise SpecbuildError(f"{file}: field format_version is missing")
    version = manifest["format_version"]
    if not _is_int(version):
        raise SpecbuildError(f"{file}: field format_version must be an integer, got {_describe(version)}")
    if version != ef.ENGINE_FORMAT_VERSION:
        raise SpecbuildError(
            f"{file}: engine format version {version} is not supported by this specbuild (reads version "
            f"{ef.ENGINE_FORMAT_VERSION}); rebuild the engine with `specbuild build`"
        )
    if "checksums" not in manifest:
        raise SpecbuildError(
            f"{file}: field checksums is missing (the engine was built before specbuild recorded file sizes and "
            f"hashes, or the field was removed); rebuild the engine with `specbuild build`"
        )
    try:
        _validate(manifest, SCHEMA, "")
        _check_semantics(manifest)
    except _Invalid as exc:
        raise SpecbuildError(f"{file}: {exc}") from None
    return manifest


def load_manifest(engine_dir, check_files: bool = True) -> dict:
    """Parse and validate engine.yaml; with check_files, also check every recorded file's size (one stat each)."""
    engine_dir = Path(engine_dir)
    file = engine_dir / ef.ENGINE_MANIFEST
    if not file.is_file():
        raise SpecbuildError(f"{engine_dir}: not a specbuild engine directory (no {ef.ENGINE_MANIFEST})")
    try:
        manifest = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SpecbuildError(f"{file}: invalid YAML ({exc})") from None
    validate_manifest(manifest, file)
    if check_files:
        check_sizes(engine_dir, manifest["checksums"])
    return manifest
