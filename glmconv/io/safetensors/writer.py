"""Sharded safetensors writers: HF file names and index at the end.

`ShardWriter` buffers up to one shard (for callers that do not know their tensors in advance: fixtures, tests).
`PlannedShardWriter` is handed every tensor's name, dtype and shape up front, so it decides shard membership
and each shard's header before any data arrives, and then streams each tensor's bytes straight to its place
in the file: memory is one tensor (whatever the caller holds), not one shard.

Byte layout of a `PlannedShardWriter` shard (the one `safetensors.torch.save_file` writes for the same
tensors, byte for byte; tests/io/test_hf_writer.py compares the two): 8-byte little-endian header length, the
compact JSON header (`__metadata__` = {"format": "pt"} first, then one entry per tensor), padded with spaces
to a multiple of 8, then the data. Like safetensors, the header (and the data) list tensors by dtype --
widest first, in safetensors' own `Dtype` order -- then by name; the shard *membership* follows the plan's
order (a new shard starts where the next tensor would overflow `max_shard_bytes`, and a tensor larger than
the limit gets a shard of its own, as `ShardWriter` does). Or the caller gives the shards whole (`Shard`: any
membership, data order, names and header bytes, as `export --like` reproduces a source's files). Tensors must
arrive in the plan's order, each once and with exactly its planned bytes; each is written at its planned offset
(`pwrite`, or a kernel copy after a seek), so arrival order, shard and header order may differ without
buffering anything (a shard stays open until its last tensor is in).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Self

from glmconv.errors import CheckpointError
from glmconv.io.background_sync import BackgroundSync
from glmconv.io.byte_copy import Extent, FileCopier
from glmconv.io.dtypes import DTYPE_SIZES, torch_dtype_code
from glmconv.io.file_names import INDEX_NAME, SHARD_NAME
from glmconv.io.output import create_new, write_new
from glmconv.io.safetensors.header import METADATA_KEY

if TYPE_CHECKING:
    import torch


_PENDING = "shard-{:05d}.safetensors.partial"
FLUSH_BYTES = 1 << 30  # written into a shard since its last flush: handed to the disk in the background
FORMAT_PT = {"format": "pt"}  # the `__metadata__` safetensors.torch.save_file writes

# safetensors' `Dtype` enum in declaration order (its derived Ord); save_file sorts tensors by dtype,
# highest first, then by name. Checked against safetensors 0.8 by tests/io/test_hf_writer.py.
_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
                "F64", "I64", "U64")
_DTYPE_RANK = {d: i for i, d in enumerate(_DTYPE_ORDER)}
_ITEMSIZE = {d: DTYPE_SIZES[d] for d in _DTYPE_ORDER if d in DTYPE_SIZES}  # what can be written


class _Closing:
    """A writer used as a context: `close()` on success, `abort()` (delete what was written) on an error."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def close(self) -> object:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class ShardWriter(_Closing):
    """Buffers tensors up to `max_shard_bytes`, flushes each shard to disk, names them all on `close()`.

    Shard count is unknown until the end, so shards are written under pending names and renamed to
    `model-0000i-of-0000N.safetensors` by `close()`, which also writes `model.safetensors.index.json`.
    A tensor larger than `max_shard_bytes` gets a shard of its own.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int) -> None:
        if max_shard_bytes < 1:
            raise CheckpointError(f"max shard size must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shard_of: dict[str, int] = {}
        self._shards = 0
        self.total_size = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes the current shard first if this one would overflow it."""
        if self._closed:
            raise CheckpointError("ShardWriter is closed")
        if name in self._shard_of or name in self._buffer:
            raise CheckpointError(f"{name}: written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().contiguous()
        self._buffer_bytes += nbytes
        self.total_size += nbytes

    def close(self) -> dict[str, str]:
        """Flush, rename shards to their final names, write the index; returns the weight map."""
        if self._closed:
            raise CheckpointError("ShardWriter is closed")
        if self._buffer:
            self._flush()
        if not self._shards:
            raise CheckpointError("no tensors were written")
        self._closed = True
        final = {i: SHARD_NAME.format(i, self._shards) for i in range(1, self._shards + 1)}
        for i, name in final.items():
            os.replace(self.out_dir / _PENDING.format(i), self.out_dir / name)
        weight_map = {n: final[i] for n, i in sorted(self._shard_of.items())}
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        write_new(self.out_dir / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        """Drop the buffer and delete the pending shards this writer made."""
        self._closed = True
        self._buffer.clear()
        for i in range(1, self._shards + 1):
            (self.out_dir / _PENDING.format(i)).unlink(missing_ok=True)

    @property
    def shards(self) -> int:
        return self._shards

    def _flush(self) -> None:
        """Write the buffered tensors as the next pending shard: the bytes `save_file` writes, into a file glmconv
        creates (so its mode is every other output file's, and no symlink is followed)."""
        path = self.out_dir / _PENDING.format(self._shards + 1)
        planned = [PlannedTensor(name, _dtype_code(t), tuple(t.shape)) for name, t in self._buffer.items()]
        head, offsets = shard_header(planned)
        try:
            fd = create_new(path)
            self._shards += 1  # only now: abort() deletes shards 1..shards, never a file it did not create
            try:
                _pwrite_all(fd, head, 0)
                for name, tensor in self._buffer.items():
                    _pwrite_all(fd, TensorBytes.of(tensor).data, offsets[name])
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"{path}: write failed ({exc.strerror or exc})") from None
        for name in self._buffer:
            self._shard_of[name] = self._shards
        self._buffer = {}
        self._buffer_bytes = 0


# ---- planned, streaming ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedTensor:
    """One tensor a `PlannedShardWriter` will receive: name, safetensors dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise CheckpointError(f"{self.name}: dtype {self.dtype} cannot be written to safetensors")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def plan_shards(tensors: Iterable[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split `tensors` (in order) into shards the way `ShardWriter.add` does: a new shard starts where the next
    tensor would overflow `max_shard_bytes`; a tensor larger than the limit ends up alone in its shard."""
    if max_shard_bytes < 1:
        raise CheckpointError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[PlannedTensor]] = []
    size = 0
    for t in tensors:
        if not shards or (shards[-1] and size + t.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


@dataclass(frozen=True)
class Shard:
    """One file a `PlannedShardWriter` writes: its tensors in data order, its final name (None: `model-i-of-N`),
    its header's `__metadata__` (None: none) and, where a source's header is reproduced exactly, those bytes."""

    tensors: tuple[PlannedTensor, ...]
    name: str | None = None
    metadata: dict[str, str] | None = field(default_factory=lambda: dict(FORMAT_PT))
    head: bytes | None = None  # the whole header (length prefix included), written as it is

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def size_shards(tensors: Iterable[PlannedTensor], max_shard_bytes: int) -> list[Shard]:
    """`plan_shards`, each shard's data in safetensors' own order (widest dtype first, then by name)."""
    return [Shard(tuple(sorted(s, key=lambda t: (-_DTYPE_RANK[t.dtype], t.name))))
            for s in plan_shards(tensors, max_shard_bytes)]


def shard_header(tensors: Iterable[PlannedTensor]) -> tuple[bytes, dict[str, int]]:
    """The first bytes (length prefix + padded JSON header) of a shard of `tensors` as safetensors writes it, and
    each tensor's absolute file offset."""
    return shard_head(Shard(tuple(sorted(tensors, key=lambda t: (-_DTYPE_RANK[t.dtype], t.name)))))


def shard_head(shard: Shard) -> tuple[bytes, dict[str, int]]:
    """`shard`'s first bytes (its own `head`, else compact JSON padded with spaces to a multiple of 8, as
    safetensors writes it) and each tensor's absolute file offset (tensors in the shard's data order)."""
    entries: dict[str, object] = {} if shard.metadata is None else {METADATA_KEY: shard.metadata}
    rel: dict[str, int] = {}
    pos = 0
    for t in shard.tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        rel[t.name] = pos
        pos += t.nbytes
    head = shard.head
    if head is None:
        text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        head = struct.pack("<Q", len(text)) + text
    return head, {name: len(head) + off for name, off in rel.items()}


class PlannedShardWriter(_Closing):
    """Writes planned tensors into safetensors shards as they come: header first, then each tensor's bytes.

    `tensors` is the order they arrive in; `shards` either the largest shard in bytes (safetensors' layout, cut
    in arrival order) or the shards themselves (`Shard`: any membership and data order, several files open at
    once). `write(name, tensor)` and `copy(name, extents, copier)` take the tensors in arrival order; anything
    else -- a tensor out of order, unplanned, twice, or with other bytes, dtype or shape than planned -- is a
    CheckpointError naming it, and the writer deletes every pending shard it made (so does any failed write).
    Shards are written under pending names; `close()` checks that every planned tensor came and gives them their
    final names: theirs, or `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`.
    With `sync`, every GiB written and every finished shard is flushed on a background thread while the writing
    goes on, and `close()` returns once all of it is on disk: the disk writes while the next tensors are made,
    instead of all at the end (real-cut4's FP8 export on an H100 spent 4.9 of 22 s in one fsync at its publish).
    """

    def __init__(self, out_dir: str | Path, tensors: Iterable[PlannedTensor], shards: int | list[Shard],
                 sync: bool = False) -> None:
        planned = list(tensors)
        seen: set[str] = set()
        for t in planned:
            if t.name in seen:
                raise CheckpointError(f"{t.name}: planned twice")
            seen.add(t.name)
        self.out_dir = Path(out_dir)
        self._shards = size_shards(planned, shards) if isinstance(shards, int) else list(shards)
        self._order = planned
        self._shard_no = {t.name: i for i, shard in enumerate(self._shards, 1) for t in shard.tensors}
        _check_cover(planned, self._shards, self._shard_no)
        self._position = {t.name: i for i, t in enumerate(self._order)}
        self._left = {i: len(shard.tensors) for i, shard in enumerate(self._shards, 1)}
        self.total_size = sum(t.nbytes for t in planned)
        self._next = 0  # index into _order of the tensor expected next
        self._fds: dict[int, int] = {}  # open shards
        self._offsets: dict[str, int] = {}
        self._planned_size: dict[int, int] = {}  # each opened shard's size once complete: header and data
        self._opened: list[int] = []
        self._writing = 1  # the shard of the tensor being written, for error messages
        self._closed = False
        self._syncer = BackgroundSync() if sync else None
        self._unflushed: dict[int, int] = {}  # each open shard's bytes written since its last flush handed over
        self.out_dir.mkdir(parents=True, exist_ok=True)

    @property
    def shards(self) -> int:
        return len(self._shards)

    def write(self, name: str, tensor: torch.Tensor | TensorBytes) -> None:
        """The next planned tensor, from memory (its bytes taken here, or already by `TensorBytes.of`)."""
        t = self._expect(name)
        try:
            ready = tensor if isinstance(tensor, TensorBytes) else TensorBytes.of(tensor)
            got = _dtype_code(ready.tensor)
            if got != t.dtype or tuple(ready.tensor.shape) != t.shape:
                raise CheckpointError(f"{name}: {got} {list(ready.tensor.shape)} written, planned {t.dtype} "
                                      f"{list(t.shape)}")
            self._check_size(t, ready.nbytes)
            _pwrite_all(self._fd_for(t), ready.data, self._offsets[name])
            self._done(t, ready.nbytes)
        except BaseException as exc:
            self._fail(exc)

    def copy(self, name: str, extents: list[Extent], copier: FileCopier) -> int:
        """The next planned tensor, as byte ranges of files (copied by the kernel where it can)."""
        t = self._expect(name)
        try:
            self._check_size(t, sum(e.length for e in extents))
            fd = self._fd_for(t)
            os.lseek(fd, self._offsets[name], os.SEEK_SET)
            copied = copier.copy(extents, fd)
            self._check_size(t, copied)
            self._done(t, copied)
        except BaseException as exc:
            self._fail(exc)
        return copied

    def close(self) -> dict[str, str]:
        """Check that every planned tensor was written and name the shards (writing the index when they are
        `model-i-of-N`); the weight map."""
        if self._closed:
            raise CheckpointError("PlannedShardWriter is closed")
        if self._next < len(self._order):
            missing = self._order[self._next]
            more = len(self._order) - self._next - 1
            self.abort()
            raise CheckpointError(f"{missing.name}: planned for {self.out_dir} but never written"
                                  + (f" (and {more} more)" if more else ""))
        if not self._order:
            self.abort()
            raise CheckpointError("no tensors were written")
        self._closed = True
        count = len(self._shards)
        final = {i: s.name or SHARD_NAME.format(i, count) for i, s in enumerate(self._shards, 1)}
        if self._syncer is not None:
            try:
                self._syncer.wait()  # every shard on disk
            except CheckpointError:
                self.abort()
                raise
        try:
            for i, fname in final.items():
                os.replace(self.out_dir / _PENDING.format(i), self.out_dir / fname)
            weight_map = {n: final[i] for n, i in sorted(self._shard_no.items())}
            if all(s.name is None for s in self._shards):
                index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
                write_new(self.out_dir / INDEX_NAME, json.dumps(index, indent=2) + "\n")
        except OSError as exc:
            raise CheckpointError(f"{self.out_dir}: cannot name the shards ({exc.strerror or exc})") from None
        return weight_map

    def abort(self) -> None:
        """Close the open shards and delete every pending shard this writer made."""
        self._closed = True
        if self._syncer is not None:
            self._syncer.close()
        self._close_all()
        for i in self._opened:
            (self.out_dir / _PENDING.format(i)).unlink(missing_ok=True)

    # -- internals ------------------------------------------------------------------------------------

    def _expect(self, name: str) -> PlannedTensor:
        if self._closed:
            raise CheckpointError(f"{name}: PlannedShardWriter is closed")
        if self._next < len(self._order) and self._order[self._next].name == name:
            return self._order[self._next]
        if name not in self._position:
            why = f"{name}: not planned for {self.out_dir}"
        elif self._position[name] < self._next:
            why = f"{name}: written twice"
        else:
            want = self._order[self._next].name if self._next < len(self._order) else "nothing"
            why = f"{name}: out of order ({want} is planned next)"
        self.abort()
        raise CheckpointError(why)

    @staticmethod
    def _check_size(t: PlannedTensor, nbytes: int) -> None:
        if nbytes != t.nbytes:
            raise CheckpointError(f"{t.name}: {nbytes} bytes written, planned {t.nbytes} ({t.dtype} {list(t.shape)})")

    def _fd_for(self, t: PlannedTensor) -> int:
        """The open shard `t` belongs to; opens it (writing its header) at its first tensor."""
        no = self._writing = self._shard_no[t.name]
        if no not in self._fds:
            self._open_shard(no)
        return self._fds[no]

    def _open_shard(self, no: int) -> None:
        head, offsets = shard_head(self._shards[no - 1])
        self._offsets.update(offsets)
        self._planned_size[no] = len(head) + self._shards[no - 1].nbytes
        path = self.out_dir / _PENDING.format(no)
        fd = create_new(path)
        self._fds[no] = fd
        self._opened.append(no)  # only now: abort() deletes the opened shards, never a file it did not create
        _pwrite_all(fd, head, 0)

    def _done(self, t: PlannedTensor, nbytes: int) -> None:
        self._next += 1
        no = self._shard_no[t.name]
        self._left[no] -= 1
        self._unflushed[no] = self._unflushed.get(no, 0) + nbytes
        if self._left[no] == 0 and no in self._fds:
            size, planned = os.fstat(self._fds[no]).st_size, self._planned_size[no]
            if size != planned:
                raise CheckpointError(f"{self.out_dir / _PENDING.format(no)}: {size} bytes after its last "
                                      f"tensor, planned {planned}")
            self._flush(no)
            os.close(self._fds.pop(no))
        elif self._unflushed[no] >= FLUSH_BYTES and self._syncer is not None and not self._syncer.busy():
            self._flush(no)

    def _flush(self, no: int) -> None:
        """Shard `no`'s bytes so far handed to the background flush (a finished shard always)."""
        if self._syncer is not None:
            self._syncer.submit_fd(self.out_dir / _PENDING.format(no), self._fds[no])
        self._unflushed.pop(no, None)

    def _close_all(self) -> None:
        while self._fds:
            _, fd = self._fds.popitem()
            os.close(fd)

    def _fail(self, exc: BaseException) -> NoReturn:
        self.abort()
        if isinstance(exc, OSError):
            path = self.out_dir / _PENDING.format(self._writing)
            raise CheckpointError(f"{path}: write failed ({exc.strerror or exc})") from None
        raise exc


def _check_cover(planned: list[PlannedTensor], shards: list[Shard], shard_no: dict[str, int]) -> None:
    """Every planned tensor in exactly one shard, as planned, and nothing else in any."""
    listed = [t for s in shards for t in s.tensors]
    if len(listed) != len(shard_no) or set(listed) != set(planned):
        odd = sorted({t.name for t in set(listed) ^ set(planned)} or {t.name for t in listed})
        raise CheckpointError(f"{odd[0]}: the shards do not hold the planned tensors exactly once")


@dataclass(frozen=True)
class TensorBytes:
    """A tensor and its bytes in C order, taken on the thread that made it: a writer's thread then only checks and
    writes (each torch call there waits for the interpreter lock the threads making tensors hold)."""

    tensor: torch.Tensor
    data: memoryview

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorBytes:
        flat = tensor.detach().contiguous().reshape(-1).view(_u8())
        return TensorBytes(tensor, flat.numpy().data.cast("B"))  # the array keeps `flat` alive

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _pwrite_all(fd: int, data: bytes | memoryview, pos: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def _dtype_code(tensor: torch.Tensor) -> str:
    try:
        return torch_dtype_code(tensor.dtype)
    except CheckpointError:
        return str(tensor.dtype)  # reported as a mismatch with the planned dtype


def _u8() -> torch.dtype:
    import torch

    return torch.uint8
