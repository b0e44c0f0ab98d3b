"""Safetensors shards planned from a lazy graph and written piece by piece.

Every output tensor's shard and offset is planned first (nothing computed); then tensors are read
from their files a few rows at a time, converted on one mlx stream per core and written at their
offsets by a writer thread, the three overlapping, so memory holds a few pieces of a few MB
whatever the largest tensor.  A tensor a sanitizer transformed is read whole and converted alone.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .files import safetensors_files
from ..errors import CheckpointError, MTPError

_SAFETENSORS_DTYPES = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int64: "I64", mx.int32: "I32", mx.int16: "I16",
    mx.int8: "I8", mx.uint64: "U64", mx.uint32: "U32", mx.uint16: "U16", mx.uint8: "U8", mx.bool_: "BOOL",
}
_MX_DTYPES = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
_MX_DTYPES["F8_E4M3"] = mx.uint8  # as mx.load reads FP8 (a sanitizer dequantizes it with its weight_scale_inv)

# Source bytes quantized as one piece of work.  Quantizing is row-wise (groups run along the last
# axis), so a tensor cut into pieces of whole rows quantizes to exactly the same bytes; small
# pieces keep memory flat whatever the largest tensor, and let pieces run on several cores.
PIECE_BYTES = 8 << 20


@dataclass(frozen=True)
class _FileTensor:
    """Where a source tensor's bytes lie in its safetensors file, so it can be read a few rows at
    a time instead of whole."""

    name: str
    file: Path
    start: int
    dtype: mx.Dtype
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        count = 1
        for d in self.shape[1:]:
            count *= d
        return count * self.dtype.size


class _Reader:
    """Reads rows of source tensors through one open file per shard into one reused buffer
    (``mx.array`` copies it), so reading costs one copy out of the page cache and no page faults."""

    def __init__(self):
        self._handles: dict[Path, object] = {}
        self._buffer = np.empty(0, np.uint8)

    def read_rows(self, tensor: _FileTensor, first: int, last: int) -> mx.array:
        count = (last - first) * tensor.row_bytes
        if self._buffer.size < count:
            self._buffer = np.empty(count, np.uint8)
        data = self._buffer[:count]
        handle = self._handle(tensor.file)
        handle.seek(tensor.start + first * tensor.row_bytes)
        done = 0
        while done < count:
            got = handle.readinto(memoryview(data)[done:])
            if not got:
                raise CheckpointError(f"{tensor.file}: truncated (tensor {tensor.name} runs past the end of the file)")
            done += got
        shape = (last - first, *tensor.shape[1:]) if tensor.shape else ()
        return mx.array(data).view(tensor.dtype).reshape(shape)

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = open(file, "rb", buffering=0)
        return self._handles[file]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def file_tensors(directory: Path, files: list[Path] | None = None) -> dict[str, _FileTensor]:
    """name -> _FileTensor for every tensor of a checkpoint, or of those of its ``files`` (headers
    already validated)."""
    found = {}
    for file in safetensors_files(directory) if files is None else files:
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                found[name] = _FileTensor(name, file, 8 + length + entry["data_offsets"][0],
                                          _MX_DTYPES[entry["dtype"]], tuple(entry["shape"]))
    return found


@dataclass
class _Slot:
    """An output tensor's place: its shard and the file offset of its first byte."""

    shard: "_Shard"
    offset: int
    nbytes: int


@dataclass
class _Shard:
    entries: dict = field(default_factory=dict)  # safetensors header entries, in file order
    size: int = 0  # data bytes
    filename: str = ""
    fd: int | None = None


class ShardLayout:
    """Decides which shard each output tensor goes to, and where, before anything is computed:
    shapes and dtypes are known from the lazy graph, so each header is written first and the
    pieces of a tensor can be written as they come, at their offsets.  Headers are padded with
    spaces (as the safetensors format allows) to ``header_room``, the bound ``header_room`` gives
    for every shard, as the quantizer has always written them."""

    def __init__(self, budget: int, header_room: int):
        self.budget = budget
        self.header_room = header_room + (-header_room % 8)
        self.shards: list[_Shard] = []

    def place(self, name: str, array: mx.array) -> _Slot:
        nbytes = int(array.nbytes)
        if not self.shards or (self.shards[-1].entries and self.shards[-1].size + nbytes > self.budget):
            self.shards.append(_Shard())
        shard = self.shards[-1]
        shard.entries[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape),
                               "data_offsets": [shard.size, shard.size + nbytes]}
        slot = _Slot(shard, 8 + self.header_room + shard.size, nbytes)
        shard.size += nbytes
        return slot

    def header(self, shard: _Shard) -> bytes:
        header = json.dumps({"__metadata__": {"format": "mlx"}, **shard.entries}, separators=(",", ":")).encode()
        if len(header) > self.header_room:  # cannot happen with header_room from header_room()
            raise RuntimeError("safetensors header larger than the room reserved for it")
        return self.header_room.to_bytes(8, "little") + header + b" " * (self.header_room - len(header))

    def open(self, directory: Path) -> None:
        """Create every shard file at its full size with its header in place."""
        for shard in self.shards:
            path = directory / shard.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            shard.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(shard.fd, 8 + self.header_room + shard.size)
            _pwrite_all(shard.fd, self.header(shard), 0)

    def close(self) -> None:
        for shard in self.shards:
            if shard.fd is not None:
                os.close(shard.fd)
                shard.fd = None


def name_trunk_shards(shards: list[_Shard]) -> None:
    for i, shard in enumerate(shards, start=1):
        shard.filename = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:  # one write may be short (Linux caps it near 2 GiB)
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class _Writer:
    """A thread that writes finished pieces to their shards while the next ones are quantized.
    Its queue is bounded, so memory holds a few pieces.  An error is kept and raised in the
    producer's thread, and the thread drains its queue to the end, so a producer never blocks on
    a writer that has stopped."""

    def __init__(self, depth: int):
        self._queue: queue.Queue = queue.Queue(depth)
        self._error: BaseException | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="omlx-mtp-quantize-writer", daemon=True)
        self._thread.start()

    def put(self, fd: int, array: mx.array, offset: int) -> None:
        self._raise_error()
        self._queue.put((fd, array, offset))

    def _run(self):
        while (item := self._queue.get()) is not None:
            if self._error is None and not self._cancelled:
                try:
                    _pwrite_all(*item)
                except BaseException as exc:  # raised in the producer's thread
                    self._error = exc
            item = None  # the piece's memory is freed here, not at the next get
            self._queue.task_done()
        self._queue.task_done()

    def drain(self) -> None:
        """Wait until every piece handed over is written (and its memory freed)."""
        self._queue.join()
        self._raise_error()

    def _raise_error(self):
        if isinstance(self._error, OSError):
            raise MTPError(f"writing the quantized checkpoint failed: {self._error}") from self._error
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait for every piece to be written; raise the writer's error if it had one."""
        self.stop()
        self._raise_error()

    def stop(self, cancel: bool = False) -> None:
        self._cancelled = self._cancelled or cancel
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


@dataclass
class _Job:
    """One source tensor: where its data comes from (a file region, or a lazy array when mlx-lm or
    mlx-vlm has transformed it), how to convert it, and where its outputs go."""

    name: str
    source: _FileTensor | mx.array
    scheme: dict | None
    slots: list[_Slot]
    nbytes: int
    rows_per_piece: int = 1


@functools.cache
def _compute_streams() -> tuple:
    """Streams that quantize pieces side by side (each runs on its own thread); made once, since
    mlx keeps a stream's thread for the life of the process."""
    count = max(1, min(os.cpu_count() or 1, 4))
    return tuple(mx.new_stream(mx.default_device()) for _ in range(count))


def _pieces(jobs: deque):
    """(job, first row, last row) in job order; a lazy array is one piece.  Jobs are taken off the
    deque so that a finished job's data is freed."""
    while jobs:
        job = jobs.popleft()
        if not isinstance(job.source, _FileTensor):
            yield job, 0, None
            continue
        rows = job.source.rows
        for first in range(0, rows, job.rows_per_piece):
            yield job, first, min(rows, first + job.rows_per_piece)


def _start_piece(job: _Job, first: int, last: int | None, reader: _Reader, dtype, stream):
    """Read a piece and set its conversion running; returns what `_finish_piece` needs."""
    array = job.source if last is None else reader.read_rows(job.source, first, last)
    with mx.stream(stream):
        parts = [mx.contiguous(value) for _, value in _convert(job.name, array, job.scheme, dtype)]
    mx.async_eval(parts)
    return job, first, last, parts


def _finish_piece(started, writer: _Writer) -> int:
    """Wait for a piece, hand its outputs to the writer; returns its source bytes."""
    job, first, last, parts = started
    mx.eval(parts)
    rows = job.source.rows if last is not None else 1
    for slot, part in zip(job.slots, parts):
        writer.put(slot.shard.fd, part, slot.offset + first * (slot.nbytes // rows))
    return job.nbytes if last is None else (last - first) * job.source.row_bytes


def convert_all(jobs: deque, dtype, bar) -> None:
    """Read, quantize and write every job, overlapping the three: the main thread reads piece n
    while the compute streams convert the pieces before it and the writer writes older ones."""
    streams = _compute_streams()
    depth = 2 * len(streams)
    writer = _Writer(3 * depth)
    reader = _Reader()
    in_flight: deque = deque()
    try:
        for n, (job, first, last) in enumerate(_pieces(jobs)):
            whole = last is None  # a tensor mlx-lm or mlx-vlm transformed is read whole: one at a time,
            if whole:  # nothing else in flight or queued, so memory stays near that one tensor
                while in_flight:
                    bar.update(_finish_piece(in_flight.popleft(), writer))
                writer.drain()
            in_flight.append(_start_piece(job, first, last, reader, dtype, streams[n % len(streams)]))
            if whole or len(in_flight) > depth:
                bar.update(_finish_piece(in_flight.popleft(), writer))
                if whole:
                    writer.drain()
        while in_flight:
            bar.update(_finish_piece(in_flight.popleft(), writer))
        writer.finish()
    finally:
        writer.stop(cancel=True)
        reader.close()


def plan_jobs(sources: deque, trunk_layout: "ShardLayout", mtp_layout: "ShardLayout", dtype) -> deque:
    """Sources -> jobs, emptying `sources` so that only the jobs reference lazy arrays: each is
    dropped once written, so the evaluated data of finished tensors is freed."""
    jobs = deque()
    while sources:
        name, array, scheme, is_mtp, region = sources.popleft()
        jobs.append(_plan(name, array, scheme, region, mtp_layout if is_mtp else trunk_layout, dtype))
    return jobs


def _plan(name: str, array: mx.array, scheme, region: _FileTensor | None, layout: ShardLayout, dtype) -> _Job:
    """Place a tensor's outputs (from the lazy graph: nothing is computed) and decide how it is read:
    a few rows at a time from its file when it is a plain source tensor and every output keeps its
    rows, else whole from the lazy array."""
    outputs = list(_convert(name, array, scheme, dtype))
    slots = [layout.place(out_name, value) for out_name, value in outputs]
    if region is None:
        return _Job(name, array, scheme, slots, int(array.nbytes))
    keeps_rows = all(value.ndim and value.shape[0] == region.rows for _, value in outputs)
    step = max(1, PIECE_BYTES // max(1, region.row_bytes)) if keeps_rows else region.rows
    return _Job(name, region, scheme, slots, int(array.nbytes), step)


def header_room(shapes) -> int:
    """An upper bound on the header of a shard holding every tensor's outputs (weight, scales, biases)."""
    per_entry = len('"":{"dtype":"BF16","shape":[],"data_offsets":[,]},') + 2 * 20
    room = 256
    for name, shape in shapes:
        shape = len(",".join(str(d) for d in shape)) + 24
        room += 3 * (len(name) + len(".scales") + per_entry + shape)
    return room


def _convert(name: str, array: mx.array, scheme, dtype):
    if scheme is None:
        if mx.issubdtype(array.dtype, mx.floating):
            array = array.astype(dtype)
        yield name, array
        return
    path = name[: -len(".weight")]
    parts = mx.quantize(array.astype(dtype), group_size=scheme["group_size"], bits=scheme["bits"], mode=scheme["mode"])
    yield f"{path}.weight", parts[0]
    yield f"{path}.scales", parts[1]
    if len(parts) > 2 and parts[2] is not None:
        yield f"{path}.biases", parts[2]
