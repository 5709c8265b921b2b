"""One weights file for all of an engine's graphs: every distinct tensor byte string is stored once.

The portable graph and the ONNX Runtime graph are exported from the same network, so most of their weights are
byte-identical (the packed QKV, the MLP, norms, int4 blocks and scales, ...). `share_weights` rewrites each graph's
external-data references into one file, deduplicated by sha256, streaming tensor by tensor (memory stays small even
for large models), and removes the per-graph data files.
"""

from __future__ import annotations

import hashlib
import mmap
from pathlib import Path

import onnx
from onnx import external_data_helper

from specbuild.engine_format import ENGINE_WEIGHTS as WEIGHTS_FILE

ALIGN = 64  # bytes: tensors start on cache-line boundaries
# tensors of MAP_ABOVE bytes or more start on page boundaries: ONNX Runtime memory-maps such external data on CPU
# instead of copying it into its own buffers (a large engine loads as fast as the disk allows)
PAGE = 4096
MAP_ABOVE = 1024 * 1024
INLINE_BELOW = 1024  # bytes: smaller tensors stay inside the graph file


def share_weights(engine_dir: Path, graph_files: list[str], name: str = WEIGHTS_FILE) -> dict[str, int]:
    """Move the tensors of every graph in `graph_files` (paths relative to engine_dir) into engine_dir/name.

    Returns {"bytes": size of the weights file, "tensors": tensors stored, "shared": references that reused
    bytes already stored}."""
    engine_dir = Path(engine_dir)
    if len(graph_files) == 1:
        adopted = _adopt(engine_dir, graph_files[0], name)
        if adopted is not None:
            return adopted
    stored: dict[str, tuple[int, int]] = {}
    sources: dict[Path, mmap.mmap] = {}
    files = []
    shared = 0
    try:
        with open(engine_dir / name, "wb") as out:
            for graph_file in graph_files:
                model = onnx.load(str(engine_dir / graph_file), load_external_data=False)
                for tensor in external_data_helper._get_all_tensors(model):
                    data = _tensor_bytes(tensor, engine_dir, sources, files)
                    if data is None:
                        continue
                    if len(data) < INLINE_BELOW:
                        _inline(tensor, data)
                        continue
                    digest = hashlib.sha256(data).hexdigest()
                    if digest in stored:
                        shared += 1
                    else:
                        pad = -out.tell() % alignment(len(data))
                        out.write(b"\0" * pad)
                        stored[digest] = (out.tell(), len(data))
                        out.write(data)
                    offset, length = stored[digest]
                    _point(tensor, name, offset, length)
                onnx.save(model, str(engine_dir / graph_file))
            size = out.tell()
    finally:
        for view in sources.values():
            view.close()
    for file in set(files):
        if file.name != name and file.exists():
            file.unlink()
    return {"bytes": size, "tensors": len(stored), "shared": shared}


def alignment(length: int) -> int:
    """Where a tensor of `length` bytes starts in the weights file: a multiple of this."""
    return PAGE if length >= MAP_ABOVE else ALIGN


def _adopt(engine_dir: Path, graph_file: str, name: str) -> dict[str, int] | None:
    """One graph whose tensors all live, aligned, in one data file: that file becomes the weights file (renamed, not
    copied: the bytes are written once) and the small tensors go inside the graph. None where it cannot."""
    model = onnx.load(str(engine_dir / graph_file), load_external_data=False)
    tensors = [t for t in external_data_helper._get_all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]
    infos = [external_data_helper.ExternalDataInfo(t) for t in tensors]
    locations = {info.location for info in infos}
    if len(locations) != 1 or any(
        info.length is None or (info.length >= INLINE_BELOW and (info.offset or 0) % alignment(info.length))
        for info in infos
    ):
        return None
    source = engine_dir / locations.pop()
    with open(source, "rb") as fh:
        for tensor, info in zip(tensors, infos):
            if info.length < INLINE_BELOW:
                fh.seek(info.offset or 0)
                _inline(tensor, fh.read(info.length))
            else:
                _point(tensor, name, info.offset or 0, info.length)
    source.replace(engine_dir / name)
    onnx.save(model, str(engine_dir / graph_file))
    big = [info for info in infos if info.length >= INLINE_BELOW]
    return {"bytes": (engine_dir / name).stat().st_size, "tensors": len(big), "shared": 0}


def _tensor_bytes(tensor, engine_dir: Path, sources: dict, files: list) -> bytes | None:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = external_data_helper.ExternalDataInfo(tensor)
        path = engine_dir / info.location
        if path not in sources:
            with open(path, "rb") as fh:
                sources[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            files.append(path)
        view = sources[path]
        start = info.offset or 0
        length = info.length if info.length is not None else len(view) - start
        return bytes(view[start : start + length])
    if tensor.HasField("raw_data") and len(tensor.raw_data) >= INLINE_BELOW:
        return tensor.raw_data
    return None


def _inline(tensor, data: bytes) -> None:
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


def _point(tensor, location: str, offset: int, length: int) -> None:
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
