"""A float graph's weights written while the graph is traced.

The exporter's trace of a step graph runs on one core for seconds and reads none of the weights' values; writing them
waits on the page cache and the disk for as long (docs/benchmarks/design-measurements.md). So `WeightsAhead` writes the
network's weights whose layout in the graph is known before the trace (planned_weights: the embedding as it is, the
decoder layers' linear weights transposed, [in, out], as builder/export/ir_weights.py folds the exporter's Transpose)
from the trace's start, on threads of its own, into the graph's data file. Once traced, each initializer that is one of
them points at its bytes (ir_weights.make_lazy claims it) and the others follow on the same threads (ir_weights.save); a
planned layout the graph did not take is a file written again the usual way, never a wrong one. A thread takes the
file's sha256 as its regions are written (TrailingDigest), so the engine's checksum needs no pass of its own.

The torch reference the graph is checked against reads the same bytes (`tensor`: a view of the file in the
network's layout; `reading`), not the checkpoint: nothing converted again, nothing copied, only the views in use
mapped.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from specbuild.builder.export.ir_weights import STEP_PREFIX
from specbuild.builder.export.weights_file import INLINE_BELOW, PAGE

WRITERS = 2  # threads reading, converting and writing weights (torch's conversions and the writes release the GIL)
_WRITE_MAX = 1 << 30  # bytes per pwrite call (Linux writes at most ~2 GB in one)


@dataclass
class Planned:
    """One tensor written by WeightsAhead: make(scratch) gives its bytes as stored (arrays of its dtype that make up
    `shape`, each at a byte offset into it), at `offset` of the data file. A network weight written ahead is
    initializer `name` of the exported graph (the step module's parameter name) stored transposed by `perm` (or as
    it is)."""

    name: str
    perm: tuple[int, ...] | None
    shape: tuple[int, ...]
    dtype: np.dtype
    make: object  # (scratch) -> its (byte offset, np.ndarray) pieces, each valid until the next is asked for
    offset: int = 0
    done: threading.Event = field(default_factory=threading.Event)  # its write ended (see written)
    written: bool = False
    claimed: bool = False

    @property
    def length(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or isinstance(getattr(tensor, "data", None), FakeTensor)


def planned_weights(step: nn.Module, weight) -> list[Planned]:
    """The network's weights of `step` (fake: made by weight(name in the network)) whose layout in the graph is
    known before it is traced, in the order its forward reads them, each over INLINE_BELOW bytes: the embedding as
    it is (a Gather reads it, and a tied lm_head's Gemm), the decoder layers' linear weights transposed (only the
    layers' MatMuls read them), their norms as they are. Not the lm_head nor the mode's own weights: a mode's
    drafting (behind an If) may read them through a Gemm of its own, as they are, beside the main graph's MatMul."""
    out = []
    parts_of = getattr(getattr(weight, "__self__", None), "weight_parts", None)  # a LazyNetwork's weight: unconverted
    for name, param in step.named_parameters():  # a tied weight once, under the name the exporter gives it
        source = name.removeprefix(STEP_PREFIX)
        if not name.startswith(STEP_PREFIX) or not _is_fake(param) or not source.startswith(_CERTAIN):
            continue
        owner, _, attr = name.rpartition(".")
        linear = isinstance(step.get_submodule(owner), nn.Linear) and attr == "weight" and param.dim() == 2
        perm = (1, 0) if linear and source.startswith("layers.") else None
        shape = tuple(int(param.shape[p]) for p in perm) if perm else tuple(int(d) for d in param.shape)
        make = functools.partial(_stored, weight, source, perm, parts_of, param.dtype)
        entry = Planned(name, perm, shape, np.dtype(str(param.dtype).removeprefix("torch.")), make)
        if entry.length > INLINE_BELOW:  # smaller ones stay inside the graph file
            out.append(entry)
    return out


_CERTAIN = ("embed_tokens.", "layers.")  # the network's weights planned_weights writes ahead


def _stored(weight, source: str, perm, parts_of, dtype: torch.dtype, scratch: _Scratch):
    """Yield weight(source) in its stored layout (transposed by perm) as (byte offset, contiguous array) pieces, each
    valid until the next is asked for. From the checkpoint's unconverted tensors (parts_of(source)) where they are
    given, through this thread's `scratch` buffers: joined, moved (torch's blocked transpose, in the checkpoint's
    dtype) and converted there, or, left as it is, converted rows at a time; else weight(source) made whole."""
    parts = parts_of(source) if parts_of is not None else None
    if parts is None:
        tensor = weight(source).detach()
        if perm is not None:
            tensor = tensor.permute(perm)
        yield 0, np.ascontiguousarray(tensor.contiguous().numpy())
        return
    shape = (sum(int(p.shape[0]) for p in parts), *parts[0].shape[1:])
    if len(parts) == 1:
        joined = parts[0]
    else:
        joined = torch.cat(parts, out=scratch.take("joined", shape, parts[0].dtype))
    if perm is None:  # rows at a time, no copy of the whole weight
        rows = max(1, _PIECE_BYTES // max(1, joined[0].numel() * dtype.itemsize))
        for start in range(0, shape[0], rows):
            piece = joined[start : start + rows]
            out = scratch.take("converted", tuple(piece.shape), dtype)
            out.copy_(piece)
            yield start * out[0].numel() * dtype.itemsize, out.numpy()
        return
    moved = joined.permute(perm)
    if joined.dtype != dtype:  # move in the checkpoint's (narrower) dtype, then convert contiguously
        moved = scratch.take("moved", tuple(moved.shape), joined.dtype).copy_(moved)
    out = scratch.take("converted", tuple(moved.shape), dtype)
    out.copy_(moved)
    yield 0, out.numpy()


_PIECE_BYTES = 16 << 20  # of a weight left in its layout, converted at a time


class _Scratch(threading.local):
    """A writer thread's buffers, used again from one weight to the next. Made anew for each weight, every converted
    copy is memory the kernel hands out (and zeroes) again: about half the system CPU of the writes
    (docs/benchmarks/design-measurements.md). A thread lets go of them once no
    planned weight is left to start (`release`)."""

    def take(self, slot: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` over buffer `slot` (grown where too small)."""
        buffers = self.__dict__.setdefault("buffers", {})
        count = int(np.prod(shape, dtype=np.int64))
        buffer = buffers.get((slot, dtype))
        if buffer is None or buffer.numel() < count:
            buffers.pop((slot, dtype), None)  # let go of the smaller one first
            buffer = buffers[(slot, dtype)] = torch.empty(count, dtype=dtype)
        return buffer[:count].view(shape)

    def release(self) -> None:
        self.__dict__.pop("buffers", None)


class WeightsAhead:
    """planned_weights(step, weight) written into the data file of the graph at `onnx_path` from start() on, the
    graph's other tensors after them (append); see the module."""

    def __init__(self, step: nn.Module, onnx_path: Path, weight):
        self.path = Path(f"{onnx_path}.data")  # where ir_weights.save puts the graph's data: the same file
        self.entries = planned_weights(step, weight)  # the network's weights written ahead (append: the others)
        self._by_name = {e.name: e for e in self.entries}
        self._planned = {id(e) for e in self.entries}
        self.appended: list[Planned] = []
        end = 0
        for entry in self.entries:
            entry.offset = -(-end // PAGE) * PAGE  # on a page: the engine's weights file adopts the file as it is
            end = entry.offset + entry.length
        self.end = end
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list = []
        self._scratch = _Scratch()  # each writer thread's own buffers
        self._unstarted = len(self.entries)  # planned weights no thread has begun to make yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fd: int | None = None
        self._digest: TrailingDigest | None = None
        self.sha256: str | None = None  # of the whole file, once finish() has seen every write succeed

    def start(self) -> None:
        with open(self.path, "wb") as fh:
            fh.truncate(self.end)  # a hole where nothing is written (the padding): reads back as zeros
        # what `tensor` reads: this file even where a save writes the graph's weights again (a new file in its place)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="specbuild-weights-ahead")
        self._futures = [self._pool.submit(self._write, entry) for entry in self.entries]
        self._digest = TrailingDigest(self._fd, self.entries)

    def _write(self, entry: Planned) -> None:
        with self._lock:
            self._unstarted -= id(entry) in self._planned
        try:
            if not self._stop.is_set():
                self._write_bytes(entry)
                entry.written = True
        finally:
            entry.done.set()  # written or not: tensor() reads the checkpoint where not
            if self._unstarted <= 0:  # what is left (appended) needs no scratch: it goes before the reference runs
                self._scratch.release()

    def _write_bytes(self, entry: Planned) -> None:
        made = 0
        fd = os.open(self.path, os.O_WRONLY)
        try:
            for start, array in entry.make(self._scratch):
                view = memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B")
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done : done + _WRITE_MAX], entry.offset + start + done)
                made += len(view)  # pieces never overlap: they add up to the weight's bytes
        finally:
            os.close(fd)
        if made != entry.length:
            raise ValueError(f"{entry.name}: made {made} bytes, planned {entry.length} ({entry.dtype} {entry.shape})")

    def append(self, tensors: list) -> list[Planned]:
        """Write each of `tensors` (onnx_ir tensors: the graph's others, once traced) after those written ahead,
        each on a page, on the same threads; finish() waits for them too."""
        added = []
        for tensor in tensors:
            dtype = np.dtype(np.uint8) if tensor.dtype.bitwidth < 8 else tensor.dtype.numpy()
            shape = (tensor.nbytes,) if tensor.dtype.bitwidth < 8 else tuple(int(d) for d in tensor.shape)
            entry = Planned(tensor.name or "", None, shape, dtype, (lambda _, t=tensor: iter([(0, _ir_bytes(t))])))
            entry.offset = -(-self.end // PAGE) * PAGE
            self.end = entry.offset + entry.length
            added.append(entry)
        with open(self.path, "r+b") as fh:
            fh.truncate(self.end)
        self.appended += added
        self._futures += [self._pool.submit(self._write, entry) for entry in added]
        self._digest.extend(added)
        return added

    def finish(self, advance=None) -> None:
        """Wait for every write (advance() once per one done); raise the first that failed. Then `sha256` is the
        file's (taken as it was written: TrailingDigest)."""
        for future in self._futures:
            future.result()
            if advance is not None:
                advance()
        self._shutdown()
        self.sha256 = self._digest.result(self.end) if self._digest is not None else None

    def close(self) -> None:
        """Stop writing (what is being written is finished) and let go of the file."""
        self._stop.set()
        self._shutdown()
        for entry in self.entries + self.appended:  # those never started: nothing waits on them
            entry.done.set()
        if self._digest is not None:
            self._digest.result(self.end)
            self._digest = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def claim(self, name: str, perm, shape, dtype: np.dtype) -> Planned | None:
        """The entry written ahead for initializer `name` in layout `perm` (None: as it is) with that stored shape and
        dtype, marked as used; None where there is none (the weight is written the usual way)."""
        entry = self._by_name.get(name)
        perm = tuple(perm) if perm is not None else None
        if entry is None or entry.claimed or entry.perm != perm:
            return None
        if entry.shape != tuple(int(d) for d in shape) or entry.dtype != np.dtype(dtype):
            return None
        entry.claimed = True
        return entry

    def external(self, entry: Planned, dtype, shape, name: str) -> ir.ExternalTensor:
        """The graph's tensor `name` for `entry`: its bytes in the file, read by nothing (an optimizer's constant
        folding, say) before they are written."""
        return _BeingWritten(entry, self.path.name, entry.offset, entry.length, dtype, shape=shape, name=name,
                             base_dir=self.path.parent)  # fmt: skip

    def unclaimed(self) -> list[str]:
        """Weights written ahead that no initializer took: their layout was not the graph's."""
        return [e.name for e in self.entries if not e.claimed]

    def tensor(self, name: str) -> torch.Tensor | None:
        """Network weight `name` (as lazy_network names it) in the network's layout, a view of its bytes in the file
        once written; None where it is not written ahead."""
        entry = self._by_name.get(STEP_PREFIX + name)
        if entry is None:
            return None
        entry.done.wait()
        if not entry.written or self._fd is None:
            return None
        # private and writable (nothing writes it): a tensor over it without torch's read-only warning, no copy
        view = mmap.mmap(self._fd, entry.length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                         offset=entry.offset)  # fmt: skip
        tensor = torch.from_numpy(np.frombuffer(view, dtype=entry.dtype).reshape(entry.shape))
        return tensor.permute(tuple(np.argsort(entry.perm).tolist())) if entry.perm is not None else tensor


class _BeingWritten(ir.ExternalTensor):
    """An external tensor whose bytes a WeightsAhead thread may still be writing: every read waits for the write
    (a graph pass between the trace and the save may fold a small weight into a constant)."""

    __slots__ = ("_entry",)

    def __init__(self, entry: Planned, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._entry = entry

    def _written(self) -> None:
        self._entry.done.wait()
        if not self._entry.written:
            raise OSError(f"{self.name}: its write to {self.path} did not complete")

    def _load(self):
        self._written()
        return super()._load()

    def tofile(self, file) -> None:
        self._written()
        super().tofile(file)


class TrailingDigest:
    """The sha256 of a file written region by region out of order (WeightsAhead's entries, in offset order), taken
    on a thread of its own that reads each region back (from the page cache) once it is written: the engine's
    checksum of its weights file (runtime/integrity.py) needs no pass of its own after the build's last write."""

    CHUNK = 1 << 20  # read back and hashed while in the CPU's cache (faster than 16 MiB reads)

    def __init__(self, fd: int, entries: list[Planned]):
        import hashlib
        import queue

        self._fd, self._hash, self._at, self._valid = fd, hashlib.sha256(), 0, True
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.extend(entries)
        self._thread = threading.Thread(target=self._run, name="specbuild-weights-digest", daemon=True)
        self._thread.start()

    def extend(self, entries: list[Planned]) -> None:
        for entry in entries:
            self._queue.put(entry)

    def _run(self) -> None:
        buffer = bytearray(self.CHUNK)
        while (entry := self._queue.get()) is not None:
            entry.done.wait()
            if not (self._valid and entry.written):
                self._valid = False
                continue
            self._read_to(entry.offset + entry.length, buffer)

    def _read_to(self, end: int, buffer: bytearray) -> None:
        view = memoryview(buffer)
        while self._at < end:
            got = os.preadv(self._fd, [view[: min(self.CHUNK, end - self._at)]], self._at)
            if got <= 0:
                self._valid = False
                return
            self._hash.update(view[:got])
            self._at += got

    def result(self, size: int) -> str | None:
        """The hex digest of the file's `size` bytes, or None where a write failed (or never ran)."""
        self._queue.put(None)
        self._thread.join()
        if self._valid and self._at == size:
            return self._hash.hexdigest()
        return None


def _ir_bytes(tensor) -> np.ndarray:
    """An onnx_ir tensor's bytes as stored (sub-byte types packed, as tobytes() packs them)."""
    if tensor.dtype.bitwidth < 8:
        return np.frombuffer(tensor.tobytes(), dtype=np.uint8)
    return np.ascontiguousarray(tensor.numpy())


@contextlib.contextmanager
def reading(step: nn.Module, ahead: WeightsAhead | None):
    """Within: the network of `step` (a streamed torch reference, lazy_network.streamed) reads the weights `ahead`
    wrote from its file instead of the checkpoint; the file is let go after."""
    source = getattr(step.net, "reading", None) if ahead is not None else None
    if source is None:
        yield
        return
    try:
        with source(ahead.tensor):
            yield
    finally:
        ahead.close()
