"""Write a safetensors file one tensor at a time (the library's save_file needs every tensor in memory at once).

The format (github.com/huggingface/safetensors, "Format"): 8 bytes little-endian header length N, N bytes of JSON
header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}} padded with spaces to a multiple
of 8, then the tensors' bytes back to back in header order. The header is computed from the shapes and dtypes before
any tensor is made, so a tensor is produced, written and dropped in turn: memory holds one tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from specbuild.errors import SpecbuildError

CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
ALIGN = 8


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_safetensors(
    path: Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `path` with the tensors named in `specs` ({name: (shape, dtype)}, in that order), each made by
    produce(name) when its turn comes. A produced tensor must match its spec. Returns the bytes written."""
    header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    for name, (shape, dtype) in specs.items():
        size = element_size(dtype)
        for dim in shape:
            size *= int(dim)
        entry = {"dtype": CODES[dtype], "shape": [int(d) for d in shape], "data_offsets": [offset, offset + size]}
        header[name] = entry
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % ALIGN)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name, (shape, dtype) in specs.items():
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise SpecbuildError(
                    f"{path}: tensor {name} came out {tuple(tensor.shape)} {tensor.dtype}, declared {tuple(shape)} "
                    f"{dtype}"
                )
            out.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
    return 8 + len(text) + offset
