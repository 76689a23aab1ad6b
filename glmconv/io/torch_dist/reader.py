"""Read global tensors (or dim-0 row ranges) of a torch_dist checkpoint, chunk by chunk, without DCP's planner.

DCP stores every chunk as `torch.save(tensor)` at (offset, length) of a `.distcp` file (torch 2.13
`dcp/filesystem.py` `_write_item`; its own reader `torch.load`s that byte range with weights_only=True and
narrows it). This reader does the same for exactly the chunks a request overlaps, so memory stays at the
request plus one chunk. `.metadata` is read through the allow-listed unpickler; chunks may split any dim
(megatron's own saver splits TP shards along dim 0 or 1 and experts along the expert axis).

`byte_extents` is the zero-copy way in: it finds where a chunk's raw bytes lie in its `.distcp` file (the
stored, uncompressed zip record `<archive>/data/<key>` of the item's torch.save archive), so that a caller can
have the kernel copy them; chunks split along dim 1 (or any dims) are copied row piece by row piece
(`chunk_grid`). It only answers when the archive is exactly what it expects -- one stored record of
exactly the chunk's bytes, little-endian, the pickle a plain contiguous tensor over the whole storage, the rest
checked as torch.load would (`stored_objects.check_tensor_archive`) -- and answers None otherwise. `read` itself
takes the bytes so located straight from the file (one copy, no archive parsed per read), the others through
torch.load, which reports any real damage.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent, read_into
from glmconv.io.checkpoint_files import require_file
from glmconv.io.dtypes import torch_dtype
from glmconv.io.file_names import DCP_METADATA_NAME, KEPT_DIR
from glmconv.io.read_buffers import ReadBuffers
from glmconv.io.torch_dist.chunk_grid import Box, Grid, boxes_of, grid
from glmconv.io.torch_dist.dcp_classes import StorageInfo, TensorStorageMetadata
from glmconv.io.torch_dist.metadata import DcpCheckpoint, inspect_torch_dist
from glmconv.io.torch_dist.metadata_check import load_metadata
from glmconv.io.torch_dist.pickle_bounds import check_pickle_bounds
from glmconv.io.torch_dist.safe_unpickle import is_a
from glmconv.io.torch_dist.stored_objects import bounded_pickles, check_tensor_archive, refused_global, torch_reason
from glmconv.io.torch_dist.zip_records import record_start, stored_record
from glmconv.numerics.finite import require_finite

if TYPE_CHECKING:
    import torch


_UNSEEN = object()  # a chunk not located yet (None: located, not locatable)


class DcpReader:
    """Random access to the tensors of one torch_dist checkpoint (tracker root or iteration directory)."""

    def __init__(self, path: str | Path, *, check_finite: bool = True, ckpt: DcpCheckpoint | None = None,
                 pin: bool = False, sibling: DcpReader | None = None, buffers: ReadBuffers | None = None) -> None:
        """`ckpt`: `inspect_torch_dist(path)` already made (by another reader of the same checkpoint), shared;
        `sibling`: another reader of it (another thread's) whose inspection and located chunks this one shares, so
        that each chunk's archive is checked once a run; `pin`: located reads go into pinned memory (for a GPU: no
        page faults once its cache holds the buffers); `buffers`: else, the CPU buffers they go into (this
        reader's thread's alone)."""
        # the tracker, metadata.json, the data files present
        if sibling is not None:
            ckpt = sibling.ckpt
        self.ckpt: DcpCheckpoint = ckpt if ckpt is not None else inspect_torch_dist(path)
        self._check_finite, self._pin, self._buffers = check_finite, pin, None if pin else buffers
        metadata = self.ckpt.metadata  # stand-ins of DCP's classes: DCP's package costs 0.6 s to import
        self._entries: dict[str, TensorStorageMetadata] = {  # `inspect_torch_dist` checked these are tensors'
            k: v for k, v in metadata.state_dict_metadata.items() if k in self.ckpt.tensors}
        self._storage: dict[tuple[str, tuple[int, ...]], StorageInfo] = {  # by (fqn, chunk offsets)
            _chunk_key(k.fqn, k.offset): v for k, v in (metadata.storage_data or {}).items()
            if k.offset is not None}
        self._cache: tuple[tuple[str, tuple[int, ...]], torch.Tensor] | None = None
        # shared with siblings: the chunks located (under one lock: each once), the files resolved, the grids
        self._raw: dict[tuple[str, tuple[int, ...]], Extent | None] = sibling._raw if sibling is not None else {}
        self._locating: threading.Lock = sibling._locating if sibling is not None else threading.Lock()
        self._files: dict[str, Path] = sibling._files if sibling is not None else {}  # rel path -> checked path
        self._grids: dict[str, Grid | None] = sibling._grids if sibling is not None else {}
        self.bytes_read = 0

    @property
    def iter_dir(self) -> Path:
        return self.ckpt.iter_dir

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._entry(name).size)

    def dtype(self, name: str) -> torch.dtype:
        """The torch dtype `name` is stored in (its code as inspecting the checkpoint read it)."""
        self._entry(name)  # a CheckpointError naming a tensor the checkpoint lacks
        return torch_dtype(self.ckpt.tensors[name].dtype)

    def chunks(self, name: str) -> list[Box]:
        """(offsets, sizes) of every stored chunk of `name`, as the metadata lists them."""
        return [(tuple(int(o) for o in c.offsets), tuple(int(z) for z in c.sizes)) for c in self._entry(name).chunks]

    def read(self, name: str, rows: tuple[int, int] | None = None, check: bool | None = None) -> torch.Tensor:
        """The global tensor `name`, or its rows [start, stop) along dim 0, assembled from every chunk (`check`:
        whether NaN/Inf is refused, None: as the reader was made; False where the caller proves it another way)."""
        import torch

        entry = self._entry(name)
        size = self.shape(name)
        start, stop = self._rows(name, size, rows)
        check = self._check_finite if check is None else check
        located = self._read_located(name, size, start, stop, check)
        if located is not None:
            return located
        whole = self._whole_chunk(name, size, start, stop, check)
        if whole is not None:
            return whole
        out = torch.empty((stop - start, *size[1:]) if size else (), dtype=self.dtype(name))
        boxes: list[Box] = []
        for chunk in entry.chunks:
            box = _intersect(name, size, chunk, start, stop)
            if box is None:
                continue
            data = self._chunk(name, chunk)
            origin = (start,) + (0,) * (len(size) - 1) if size else ()
            _region(out, box, origin).copy_(_region(data, box, tuple(int(o) for o in chunk.offsets)))
            boxes.append(box)
        _check_cover(name, boxes, (stop - start, *size[1:]) if size else (), start)
        if check:
            require_finite(out, name, str(self.iter_dir), start)
        return out

    def _read_located(self, name: str, size: tuple[int, ...], start: int, stop: int,
                      check: bool) -> torch.Tensor | None:
        """Rows [start, stop) read straight from the data files into one new tensor where every chunk's raw bytes
        are located (`byte_extents`, as zero-copy export copies them): one copy, no archive parsed per read."""
        import torch

        if not size or not self.locatable(name):
            return None
        dtype = self.dtype(name)
        row = math.prod(size[1:]) * dtype.itemsize
        shape = (stop - start, *size[1:])
        out = (self._buffers.empty(shape, dtype) if self._buffers is not None
               else torch.empty(shape, dtype=dtype, pin_memory=self._pin))
        extents = self.byte_extents(name, start * row, stop * row)
        assert extents is not None  # locatable: every chunk's bytes are located
        read_into(extents, out.reshape(-1).view(torch.uint8).numpy().data)
        self.bytes_read += out.numel() * dtype.itemsize
        if check:
            require_finite(out, name, str(self.iter_dir), start)
        return out

    def _whole_chunk(self, name: str, size: tuple[int, ...], start: int, stop: int,
                     check: bool) -> torch.Tensor | None:
        """Rows [start, stop) when they are exactly one stored chunk not already cached: that chunk as loaded,
        the caller's own (no copy into a new tensor, nothing kept that the caller might change)."""
        met = [c for c in self._entry(name).chunks if _intersect(name, size, c, start, stop) is not None]
        if len(met) != 1:
            return None
        (chunk,) = met
        offsets, sizes = tuple(int(o) for o in chunk.offsets), tuple(int(z) for z in chunk.sizes)
        want = ((start,) + (0,) * (len(size) - 1), (stop - start, *size[1:])) if size else ((), ())
        cached = self._cache
        if (offsets, sizes) != want or (cached is not None and cached[0] == (name, offsets)):
            return None
        tensor = self._load(name, chunk)
        if check:
            require_finite(tensor, name, str(self.iter_dir), start)
        return tensor

    def byte_extents(self, name: str, begin: int, end: int) -> list[Extent] | None:
        """Where bytes [begin, end) of the global tensor `name` (C order) lie in the data files, in order.

        Chunks may split any dims (a trainer's TP/EP shards): a dim-0 chunk is one extent, a chunk split along
        dim 1 one extent per row (`chunk_grid`). None when that cannot be said for certain: chunks that do not
        form a grid, or an item whose raw bytes `raw_extent` cannot locate. Rows past `end` (e.g. vocabulary
        padding) are never touched. Nothing is counted in `bytes_read`: the caller counts what it copies.
        """
        g = self.grid(name)
        if not 0 <= begin <= end <= (g.nbytes if g is not None else self._nbytes(name)):
            raise CheckpointError(f"{name}: bytes {begin}..{end} outside its {self._nbytes(name)}")
        if g is None:
            return None
        chunks = self._entry(name).chunks
        out: list[Extent] = []
        for run in g.runs(begin, end):
            raw = self.raw_extent(name, chunks[run.chunk])
            if raw is None:
                return None
            out.append(Extent(raw.path, raw.offset + run.local, run.length))
        return out

    def grid(self, name: str) -> Grid | None:
        """How the stored chunks of `name` tile it (`chunk_grid.grid`), or None when they do not form a grid."""
        if name not in self._grids:
            entry = self._entry(name)
            self._grids[name] = grid(self.shape(name), boxes_of(entry.chunks), self.dtype(name).itemsize)
        return self._grids[name]

    def locatable(self, name: str) -> bool:
        """Whether every byte of `name` can be copied from the data files (`byte_extents` answers for any range)."""
        return self.grid(name) is not None and all(self.raw_extent(name, c) is not None
                                                   for c in self._entry(name).chunks)

    def _nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * self.dtype(name).itemsize

    def raw_extent(self, name: str, chunk: Any) -> Extent | None:
        """The file bytes holding exactly `chunk`'s data (C order), or None when the item is not as expected."""
        key = _chunk_key(name, chunk.offsets)
        found = self._raw.get(key, _UNSEEN)
        if found is _UNSEEN:
            with self._locating:
                found = self._raw.get(key, _UNSEEN)
                if found is _UNSEEN:
                    found = self._raw[key] = self._locate(name, chunk)
        return found  # type: ignore[return-value]

    def _locate(self, name: str, chunk: Any) -> Extent | None:
        info = self._storage.get(_chunk_key(name, chunk.offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        path = self._data_file(name, info)
        dtype = self.dtype(name)
        sizes = tuple(int(z) for z in chunk.sizes)
        try:
            fh = open(path, "rb")
        except OSError:
            return None
        offset, length = int(info.offset), int(info.length)
        with fh:  # opened once, its zip directory read once, for both
            try:
                records = archive_records(fh, offset, length)
                found = located_in(fh, path, offset, length, records, dtype, sizes)
            except _UNLOCATABLE:
                return None
            if found is not None:  # its bytes will be copied unread: the archive checked as torch.load would
                check_tensor_archive(_Slice(fh, offset, length), f"{path.name}: {name}", dtype, sizes, records)
        return found

    def drop_cache(self) -> None:
        """Forget the last chunk read (kept so that row-by-row reads of one chunk load it once)."""
        self._cache = None

    def _entry(self, name: str) -> TensorStorageMetadata:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"{name}: not a tensor of {self.iter_dir}")
        return entry

    @staticmethod
    def _rows(name: str, size: tuple[int, ...], rows: tuple[int, int] | None) -> tuple[int, int]:
        if not size:
            if rows is not None:
                raise CheckpointError(f"{name}: a scalar has no rows")
            return 0, 1
        start, stop = rows if rows is not None else (0, size[0])
        if not 0 <= start <= stop <= size[0]:
            raise CheckpointError(f"{name}: rows {start}..{stop} outside its {size[0]} rows")
        return start, stop

    def _chunk(self, name: str, chunk: Any) -> torch.Tensor:
        """One chunk, the last one kept (a snapshot of it: threads may read through one reader at once)."""
        key = _chunk_key(name, chunk.offsets)
        cached = self._cache
        if cached is not None and cached[0] == key:
            return cached[1]
        self._cache = None  # memory: one chunk plus the one loading
        tensor = self._load(name, chunk)
        self._cache = (key, tensor)
        return tensor

    def _load(self, name: str, chunk: Any) -> torch.Tensor:
        import torch

        info = self._storage.get(_chunk_key(name, chunk.offsets))
        if info is None:
            raise CheckpointError(f"{name}: chunk at {list(chunk.offsets)} has no storage entry in {DCP_METADATA_NAME}")
        path = self._data_file(name, info)
        try:
            with open(path, "rb") as fh:  # torch.load reads the chunk in place: no copy of its bytes
                window = _Slice(fh, int(info.offset), int(info.length))  # a file-like: torch reads it and seeks
                bounded_pickles(window)  # before torch's unpickler runs: a memo bomb or a deep tuple is refused
                window.seek(0)
                tensor = torch.load(window, map_location="cpu", weights_only=True)  # type: ignore[arg-type]  # ditto
        except OSError as exc:
            raise CheckpointError(f"{path.name}: cannot read {name} ({exc.strerror or exc})") from None
        except Exception as exc:  # whatever torch.load raises on a damaged archive
            raise CheckpointError(f"{path.name}: {name}: chunk is not a readable tensor ({_line(exc)})") from None
        want = tuple(int(s) for s in chunk.sizes)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != want or tensor.dtype != self.dtype(name):
            got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"{path.name}: {name}: chunk holds {got}, metadata says {want}")
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _data_file(self, name: str, info: Any) -> Path:
        rel = str(getattr(info, "relative_path", ""))
        if not _plain_data_file(rel):
            raise CheckpointError(f"{name}: data file {rel!r} is outside the checkpoint directory")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{rel}: {name} is stored with transforms {list(info.transform_descriptors)} "
                                  "(compressed checkpoints are not supported)")
        if rel not in self._files:  # resolved once: each of a file's chunks would follow its symlinks again
            self._files[rel] = require_file(self.iter_dir, rel, f"{rel}: data file of {name} is missing from "
                                            f"{self.iter_dir}", f"{name}: data file")
        return self._files[rel]


def _plain_data_file(rel: str) -> bool:
    """A data file's name in the iteration directory, or in its KEPT_DIR sidecar: nothing else is read."""
    parts = rel.split("/")
    return (len(parts) == 1 or len(parts) == 2 and parts[0] == KEPT_DIR) and parts[-1] not in ("", ".", "..")


def _chunk_key(name: str, offsets: Any) -> tuple[str, tuple[int, ...]]:
    """A stored chunk's key: its tensor and offsets (DCP's `MetadataIndex` without its lookup hint)."""
    return name, tuple(int(o) for o in offsets)


class _Slice(io.RawIOBase):
    """The read-only window [offset, offset + length) of an open file, seekable relative to its start."""

    def __init__(self, fh: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._fh, self._start, self._len = fh, offset, length
        self._pos = 0  # kept here, not asked of the file: zipfile and torch.load ask often (a syscall each)
        fh.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        self._fh.seek(self._start + self._pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self._len - self._pos)
        got = (self._fh.readinto(memoryview(buf)[:n]) or 0) if n > 0 else 0
        self._pos += got
        return got


def _intersect(name: str, size: tuple[int, ...], chunk: Any, start: int, stop: int) -> Box | None:
    """The part of `chunk` inside rows [start, stop), in global coordinates; None when they do not meet."""
    off, sz = tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)
    if len(off) != len(size) or len(sz) != len(size) or any(o < 0 or o + s > d for o, s, d in zip(off, sz, size)):
        raise CheckpointError(f"{name}: chunk at {list(off)} of {list(sz)} does not fit the tensor's {list(size)}")
    if not size:
        return (), ()
    lo, hi = max(off[0], start), min(off[0] + sz[0], stop)
    if lo >= hi or 0 in sz:
        return None
    return (lo, *off[1:]), (hi - lo, *sz[1:])


def _region(t: torch.Tensor, box: Box, origin: tuple[int, ...]) -> torch.Tensor:
    """The view of `t` (whose element 0 sits at global `origin`) covering the global `box`."""
    for dim, (o, s, base) in enumerate(zip(box[0], box[1], origin)):
        t = t.narrow(dim, o - base, s)
    return t


def _check_cover(name: str, boxes: list[Box], shape: tuple[int, ...], start: int) -> None:
    """The chunks met must tile the request exactly: no overlap, no gap."""
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1])):
                raise CheckpointError(f"{name}: stored chunks at {list(a[0])} and {list(b[0])} overlap")
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != math.prod(shape):
        what = f"rows {start}..{start + shape[0]}" if shape else "the scalar"
        raise CheckpointError(f"{name}: stored chunks cover {covered} of the {math.prod(shape)} elements of {what}")


def _line(exc: BaseException) -> str:
    """The reason in one line: the refused global by name, or the weights-only unpickler's own words when it refused
    something (never torch's advice to allow it)."""
    if "WeightsUnpickler error:" in str(exc) or refused_global(exc):
        return torch_reason(exc)
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---- raw data of a torch.save archive ----------------------------------------------------------------

_MAX_PICKLE = 1 << 20


@dataclass(frozen=True)
class _Storage:
    """A torch.save storage as its persistent id names it."""

    dtype: Any  # the torch dtype of its `*Storage` class
    key: str  # the archive record `<name>/data/<key>` holding its bytes
    numel: int


@dataclass(frozen=True)
class _TensorRecord:
    """What `_rebuild_tensor_v2` would build a tensor from: a view of a storage."""

    storage: _Storage
    offset: int  # into the storage, in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]


def locate_tensor_data(path: Path, offset: int, length: int, dtype: Any, sizes: tuple[int, ...]) -> Extent | None:
    """The extent of `path` holding the raw data of the torch.save archive at [offset, offset + length), when the
    archive is one plain contiguous `dtype` tensor of `sizes` stored without compression; None otherwise.

    Raises OSError / zipfile.BadZipFile / pickle.UnpicklingError (and the like) on unreadable archives.
    """
    with open(path, "rb") as fh:
        return located_in(fh, path, offset, length, archive_records(fh, offset, length), dtype, sizes)


_UNLOCATABLE = (OSError, ValueError, EOFError, struct.error, zipfile.BadZipFile, pickle.UnpicklingError, KeyError,
                TypeError, AttributeError, IndexError)  # what an archive that is not as expected raises here


def archive_records(fh: io.BufferedReader, offset: int, length: int) -> list[zipfile.ZipInfo]:
    """The records of the zip archive at [offset, offset + length) of `fh`, as its central directory lists them."""
    with zipfile.ZipFile(_Slice(fh, offset, length)) as z:
        return z.infolist()


def located_in(fh: io.BufferedReader, path: Path, offset: int, length: int, records: list[zipfile.ZipInfo],
               dtype: Any, sizes: tuple[int, ...]) -> Extent | None:
    """`locate_tensor_data` with `path` already open as `fh` and the archive's `archive_records` read."""
    nbytes = math.prod(sizes) * dtype.itemsize
    infos = {i.filename: i for i in records}
    pickles = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        return None
    prefix = pickles[0][:-len("/data.pkl")]
    order = infos.get(f"{prefix}/byteorder")
    if order is not None and stored_record(fh, offset, length, order, 16) != b"little":
        return None
    record = _describe(stored_record(fh, offset, length, infos[pickles[0]], _MAX_PICKLE))
    if record is None:
        return None
    st = record.storage
    if (st.dtype != dtype or st.numel != math.prod(sizes) or record.offset != 0 or record.size != sizes
            or record.stride != _contiguous(sizes)):
        return None
    data = infos.get(f"{prefix}/data/{st.key}")
    if data is None or data.file_size != nbytes:
        return None
    start = record_start(fh, offset, length, data)
    return None if start is None else Extent(path, start, nbytes)


def _contiguous(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(sizes):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def _describe(data: bytes | None) -> _TensorRecord | None:
    """What a torch.save pickle of one tensor says, read without building anything but our own records."""
    if data is None:
        return None
    check_pickle_bounds(data)  # PickleOutOfBounds (an UnpicklingError) before any unpickler runs
    out = _TensorPickle(io.BytesIO(data)).load()
    return out if isinstance(out, _TensorRecord) else None


def _rebuild_record(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorRecord:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("tensor without a storage")
    return _TensorRecord(storage, int(storage_offset), tuple(int(x) for x in size), tuple(int(x) for x in stride))


class _StorageType:
    def __init__(self, name: str) -> None:
        from torch.storage import _get_dtype_from_pickle_storage_type

        self.dtype = _get_dtype_from_pickle_storage_type(name)


class _TensorPickle(pickle.Unpickler):
    """Understands exactly `_rebuild_tensor_v2(persistent storage, offset, size, stride, ...)`; refuses the rest."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_record
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            return _StorageType(name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return _Storage(pid[1].dtype, str(pid[2]), int(pid[4]))


# ---- DCP entries read directly: the whole `.metadata`, one BYTE_IO entry ----

def read_metadata(ckpt_dir: str | Path) -> Any:
    """The DCP `.metadata` of a checkpoint directory, unpickled through the allow-list (`safe_unpickle`)."""
    path = Path(ckpt_dir) / DCP_METADATA_NAME
    if not path.exists():
        raise CheckpointError(f"{path}: missing; not a torch_dist checkpoint")
    return load_metadata(path)


def read_bytes_entry(ckpt_dir: str | Path, key: str, *, limit: int | None = None, expected: str = "",
                     metadata: Any = None) -> bytes:
    """The raw bytes of one BYTE_IO entry (a ShardedObject such as the common state); one longer than `limit` is
    refused unread (`expected`: what the entry should be, for the message; `metadata`: as `iter_bytes_entries`)."""
    limits = {key: (limit, expected)} if limit is not None else None
    return next(iter_bytes_entries(ckpt_dir, [key], limits=limits, metadata=metadata))[1]


def iter_bytes_entries(ckpt_dir: str | Path, keys: list[str], *, limits: Mapping[str, tuple[int, str]] | None = None,
                       metadata: Any = None) -> Iterator[tuple[str, bytes]]:
    """(data file name, raw bytes) of each BYTE_IO entry `keys`, in order; `.metadata` is read once, as
    `StandIn`s, so this needs no torch (`metadata`: it, already read by `inspect_torch_dist`). `limits`: key ->
    (most bytes, what the entry should be): a longer entry is refused before it is read."""
    d = Path(ckpt_dir)
    path = d / DCP_METADATA_NAME
    if not path.exists():
        raise CheckpointError(f"{path}: missing; not a torch_dist checkpoint")
    md = metadata if metadata is not None else load_metadata(path, stand_ins=True)
    stored: dict[str, Any] = {}  # each object's first entry, found in one pass (not one pass a key)
    for k, v in (md.storage_data or {}).items():
        if k.offset is None:
            stored.setdefault(k.fqn, v)
    with _DataFiles(d) as files:  # each data file opened once (a checkpoint holds an object per module: 1,848 on
        for key in keys:  # the 3 GB bench, in a few files)
            info = stored.get(key)
            if not is_a(md.state_dict_metadata.get(key), "BytesStorageMetadata") or info is None:
                raise CheckpointError(f"{d}: no {key} entry in {DCP_METADATA_NAME}")
            if Path(info.relative_path).name != info.relative_path or getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{d}: {key} points at an unsupported location {info.relative_path!r}")
            limit, expected = (limits or {}).get(key, (None, ""))
            if limit is not None and int(info.length) > limit:
                raise CheckpointError(f"{d / info.relative_path}: {key} is {int(info.length):,} bytes, expected at "
                                      f"most {limit:,}{' for ' + expected if expected else ''}")
            yield info.relative_path, files.read(info.relative_path, int(info.offset), int(info.length), key)


class _DataFiles:
    """The data files of one checkpoint folder, each opened at its first read and closed with this."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._open: dict[str, BinaryIO] = {}

    def __enter__(self) -> _DataFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def read(self, name: str, offset: int, length: int, key: str) -> bytes:
        """`length` bytes at `offset` of data file `name`; a short read is refused as truncated (for `key`)."""
        path = self._folder / name
        try:
            f = self._open.get(name)
            if f is None:
                f = self._open[name] = open(path, "rb")
            f.seek(offset)
            data = f.read(length)
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
        if len(data) != length:
            raise CheckpointError(f"{path}: truncated ({len(data)} of {length} bytes for {key})")
        return data
