"""Reading weight files: HF model directories (single or sharded safetensors / pytorch .bin) and single tensor files.

No pickle is ever executed: `.bin`/`.pt` files load with `torch.load(weights_only=True)`, and a file whose pickle
names any non-tensor global is refused with a SpecbuildError. Every failure names the file at fault.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from specbuild.errors import SpecbuildError

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Show a progress bar only when there is enough to load for it to be worth drawing.
PROGRESS_MIN_TENSORS = 64
# Elements per isfinite() pass when checking weights (bounds the temporary mask's memory).
FINITE_CHECK_CHUNK = 1 << 24
# Training checkpoints sometimes wrap the state dict under one of these keys.
_WRAPPER_KEYS = ("state_dict", "model", "module")


def find_weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a HF model directory, in load order; every shard named by an index must exist."""
    model_dir = Path(model_dir)
    if (model_dir / SAFETENSORS_FILE).is_file():
        return [model_dir / SAFETENSORS_FILE]
    if (model_dir / SAFETENSORS_INDEX).is_file():
        return _index_shards(model_dir / SAFETENSORS_INDEX)
    if (model_dir / BIN_FILE).is_file():
        return [model_dir / BIN_FILE]
    if (model_dir / BIN_INDEX).is_file():
        return _index_shards(model_dir / BIN_INDEX)
    raise SpecbuildError(
        f"{model_dir}: no weights found (expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {BIN_FILE} or {BIN_INDEX})"
    )


def _index_shards(index_file: Path) -> list[Path]:
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecbuildError(f"{index_file}: cannot read shard index ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SpecbuildError(f"{index_file}: no 'weight_map' (not a sharded checkpoint index)")
    shards: list[Path] = []
    for name in dict.fromkeys(weight_map.values()):
        shard = index_file.parent / str(name)
        if not shard.is_file():
            raise SpecbuildError(f"{index_file}: shard {name} is listed but missing ({shard} does not exist)")
        shards.append(shard)
    return shards


def _index_weight_map(model_dir: Path) -> tuple[Path, dict[str, str]] | None:
    for name in (SAFETENSORS_INDEX, BIN_INDEX):
        index_file = model_dir / name
        if index_file.is_file():
            _index_shards(index_file)  # validates the index (readable JSON with a weight_map)
            return index_file, json.loads(index_file.read_text())["weight_map"]
    return None


class LazyTensors(Mapping):
    """{name: tensor} whose tensors are made when read (`load(name)`), one at a time: a checkpoint of any size is
    walked with one tensor in memory. `specs` gives each name's (shape, dtype) without reading it."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], load: Callable[[str], torch.Tensor]):
        self.specs = specs
        self._load = load
        self.checked: set[str] = set()  # names already checked for NaN/Inf (once per name is enough)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        return self._load(name)

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def cast(self, dtype: Callable[[str], torch.dtype], convert: Callable[[torch.Tensor, str], torch.Tensor]):
        """The same tensors, each read through convert(tensor, name), declared in dtype(name)."""
        specs = {name: (shape, dtype(name)) for name, (shape, _) in self.specs.items()}
        return LazyTensors(specs, lambda name: convert(self._load(name), name))

    def subset(self, names) -> LazyTensors:
        return LazyTensors({name: self.specs[name] for name in names}, self._load)


def spec_of(tensors: Mapping, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of tensors[name], without reading it when `tensors` is lazy."""
    if isinstance(tensors, LazyTensors):
        return tensors.specs[name]
    return tuple(tensors[name].shape), tensors[name].dtype


def open_hf_weights(model_dir: Path) -> LazyTensors:
    """The tensors of a HF model directory by their HF names, read one at a time (safetensors from their headers,
    torch files memory-mapped); each read refuses NaN/Inf naming the file."""
    model_dir = Path(model_dir)
    files = find_weight_files(model_dir)
    sharded = len(files) > 1 or files[0].name not in (SAFETENSORS_FILE, BIN_FILE)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    origin: dict[str, Path] = {}
    readers: dict[Path, Callable[[str], torch.Tensor]] = {}
    for file in files:
        file_specs, readers[file] = _open_tensor_file(file)
        for name, spec in file_specs.items():
            if name in specs:
                raise SpecbuildError(f"{file}: tensor {name} is also stored in {origin[name]}")
            specs[name], origin[name] = spec, file
    if sharded:
        index_file, weight_map = _index_weight_map(model_dir) or (None, {})
        for name, shard in weight_map.items():
            if name not in specs:
                raise SpecbuildError(f"{index_file}: tensor {name} is mapped to shard {shard} but that shard lacks it")

    def load(name: str) -> torch.Tensor:
        tensor = readers[origin[name]](name)
        if name not in lazy.checked:
            check_finite(tensor, name, origin[name])
            lazy.checked.add(name)
        return tensor

    lazy = LazyTensors(specs, load)
    return lazy


def open_tensor_file(path: Path) -> LazyTensors:
    """The tensors of one weight file, read one at a time when asked for; each read refuses NaN/Inf."""
    specs, read = _open_tensor_file(Path(path))

    def load(name: str) -> torch.Tensor:
        tensor = read(name)
        if name not in lazy.checked:
            check_finite(tensor, name, path)
            lazy.checked.add(name)
        return tensor

    lazy = LazyTensors(specs, load)
    return lazy


def load_hf_weights(model_dir: Path, progress: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of a HF model directory as CPU torch tensors keyed by their HF names (small models and heads;
    convert streams base models through open_hf_weights)."""
    model_dir = Path(model_dir)
    weights = open_hf_weights(model_dir)
    tensors = {}
    with _progress_bar(progress, model_dir, find_weight_files(model_dir)) as advance:
        for name in weights:
            tensors[name] = weights[name]
            advance(1)
    return tensors


def load_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one .safetensors, .bin, .pt or .pth file, as CPU torch tensors."""
    path = Path(path)
    if not path.is_file():
        raise SpecbuildError(f"{path}: missing")
    return dict(_iter_tensor_file(path))


def _open_tensor_file(path: Path):
    """({name: (shape, dtype)}, read(name)) of one weight file: safetensors headers are read without the data, torch
    files are memory-mapped where they are zip containers (torch.save's default)."""
    _check_readable(path)
    if path.suffix == ".safetensors":
        return _safetensors_specs(path), lambda name: _read_safetensor(path, name)
    if path.suffix in PICKLE_SUFFIXES:
        state = _load_pickle_state_dict(path)
        return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}, state.__getitem__
    raise SpecbuildError(f"{path}: unsupported weight file type (expected .safetensors, .bin, .pt or .pth)")


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def _safetensors_specs(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            specs = {}
            for name in f.keys():
                part = f.get_slice(name)
                code = part.get_dtype()
                specs[name] = (tuple(part.get_shape()), SAFETENSORS_DTYPES.get(code, code))
    except Exception as exc:  # safetensors raises SafetensorError, OSError, ... for corrupt or truncated files
        raise SpecbuildError(f"{path}: not a valid safetensors file, truncated or corrupt ({exc})") from None
    return specs


def _read_safetensor(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return f.get_tensor(name)
    except Exception as exc:
        raise SpecbuildError(f"{path}: cannot read tensor {name}, file truncated or corrupt ({exc})") from None


def _iter_tensor_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in `path`; an unreadable file or a tensor holding NaN/Inf is an error."""
    _check_readable(path)
    if path.suffix == ".safetensors":
        tensors = _iter_safetensors(path)
    elif path.suffix in PICKLE_SUFFIXES:
        tensors = iter(_load_pickle_state_dict(path).items())
    else:
        raise SpecbuildError(f"{path}: unsupported weight file type (expected .safetensors, .bin, .pt or .pth)")
    for name, tensor in tensors:
        check_finite(tensor, name, path)
        yield name, tensor


def _check_readable(path: Path) -> None:
    """One error naming the file for what the OS refuses (permissions, a directory, ...), before any parser sees it."""
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise SpecbuildError(f"{path}: cannot read ({exc.strerror or exc})") from None


# IEEE floats whose exponent bits are all ones are NaN or Inf: (bit view, exponent mask) per dtype
EXPONENT_MASKS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
}


def check_finite(tensor: torch.Tensor, name: str, source) -> None:
    """Refuse a floating-point tensor holding NaN or Inf: its min and max in one pass (the weights of a model read
    each time a build reads them), then, where one is not finite, the count for the message (in chunks, float32/16
    and bfloat16 by their exponent bits)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = torch.aminmax(tensor)  # one pass, no copy; a NaN anywhere makes both NaN, an Inf shows at an end
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return
    flat = tensor.reshape(-1)
    bits, mask = EXPONENT_MASKS.get(flat.dtype, (None, None))
    bad = 0
    for chunk in flat.split(FINITE_CHECK_CHUNK):
        if bits is not None:
            bad += int((chunk.view(bits) & mask).eq_(mask).sum())
        else:
            bad += int((~torch.isfinite(chunk.float() if chunk.dtype != torch.float64 else chunk)).sum())
    if bad:
        raise SpecbuildError(
            f"{source}: tensor {name} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or Inf) of "
            f"{tensor.numel()}; the weights are corrupt"
        )


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises SafetensorError, OSError, ... for corrupt or truncated files
        raise SpecbuildError(f"{path}: not a valid safetensors file, truncated or corrupt ({exc})") from None
    with handle as f:
        for name in f.keys():
            try:
                tensor = f.get_tensor(name)
            except Exception as exc:
                raise SpecbuildError(f"{path}: cannot read tensor {name}, file truncated or corrupt ({exc})") from None
            yield name, tensor


def _load_pickle_state_dict(path: Path) -> dict[str, torch.Tensor]:
    # mmap needs the zip container that torch.save writes by default; legacy files load without it.
    mmap = zipfile.is_zipfile(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the load still fails or succeeds
            obj = torch.load(str(path), weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        name = found.group(1) if found else _suspicious_global(path)
        what = f" (it references {name})" if name else ""
        raise SpecbuildError(
            f"{path}: holds non-tensor objects or code{what}; it was not executed. "
            "Only plain tensor state dicts are accepted (torch.load weights_only=True); re-save it as safetensors"
        ) from None
    except Exception as exc:  # corrupt zip, truncated pickle, ...
        raise SpecbuildError(
            f"{path}: cannot read torch file, truncated or corrupt ({type(exc).__name__}: {exc})"
        ) from None
    if isinstance(obj, dict) and len(obj) == 1:
        ((key, value),) = obj.items()
        if key in _WRAPPER_KEYS and isinstance(value, dict):
            obj = value
    if not isinstance(obj, dict):
        raise SpecbuildError(f"{path}: holds a {type(obj).__name__}, expected a state dict of tensors")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise SpecbuildError(
                f"{path}: entry {key!r} is a {type(value).__name__}, expected a tensor (file is not a plain state dict)"
            )
    return obj


def _suspicious_global(path: Path) -> str | None:
    """First global a pickle imports outside torch and OrderedDict, found by reading its opcodes (never executing)."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                member = next((n for n in zf.namelist() if n.endswith("data.pkl")), None)
                data = zf.read(member) if member else b""
        else:
            data = path.read_bytes()
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                name = str(arg).replace(" ", ".")
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                name = ".".join(strings[-2:])
            else:
                if isinstance(arg, str):
                    strings.append(arg)
                continue
            if not name.startswith("torch.") and name != "collections.OrderedDict":
                return name
    except Exception:  # a best-effort hint for the error message only
        return None
    return None


@contextlib.contextmanager
def _progress_bar(enabled: bool, model_dir: Path, files: list[Path]):
    """Yield advance(n); draws a rich progress bar over tensors when enabled and the checkpoint is large."""
    total = _count_tensors(files) if enabled else None
    if not enabled or (total is not None and total < PROGRESS_MIN_TENSORS):
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(f"loading {model_dir.name}", total=total)
        yield lambda n: bar.advance(task, n)


def _count_tensors(files: list[Path]) -> int | None:
    """Number of tensors across the files, from safetensors headers; None when it needs unpickling."""
    from safetensors import safe_open

    count = 0
    for file in files:
        if file.suffix != ".safetensors":
            return None
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                count += len(list(f.keys()))
        except Exception:
            return None  # the load itself reports the broken file
    return count
