"""Read global tensors (or dim-0 row ranges) of a torch_dist checkpoint, chunk by chunk, without DCP's planner.

DCP stores every chunk as `torch.save(tensor)` at (offset, length) of a `.distcp` file (torch 2.13
`dcp/filesystem.py` `_write_item`; its own reader `torch.load`s that byte range with weights_only=True and
narrows it). This reader does the same for exactly the chunks a request overlaps, so memory stays at the
request plus one chunk. `.metadata` is read through the allow-listed unpickler; chunks may split any dim
(megatron's own saver splits TP shards along dim 0 or 1 and experts along the expert axis).
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from glmconv.errors import CheckpointError
from glmconv.io.dcp_metadata import DCP_METADATA_NAME, DcpCheckpoint, inspect_torch_dist
from glmconv.io.safe_unpickle import safe_load

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


class DcpReader:
    """Random access to the tensors of one torch_dist checkpoint (tracker root or iteration directory)."""

    def __init__(self, path: str | Path, *, check_finite: bool = False) -> None:
        self.ckpt: DcpCheckpoint = inspect_torch_dist(path)  # tracker, metadata.json, data files present
        self._check_finite = check_finite
        metadata = safe_load(self.ckpt.iter_dir / DCP_METADATA_NAME)
        self._entries: dict[str, Any] = {k: v for k, v in metadata.state_dict_metadata.items()
                                         if k in self.ckpt.tensors}
        self._storage: dict[Any, Any] = dict(metadata.storage_data or {})
        self._cache: tuple[tuple[str, tuple[int, ...]], torch.Tensor] | None = None
        self.bytes_read = 0

    @property
    def iter_dir(self) -> Path:
        return self.ckpt.iter_dir

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._entry(name).size)

    def chunks(self, name: str) -> list[Box]:
        """(offsets, sizes) of every stored chunk of `name`, as the metadata lists them."""
        return [(tuple(int(o) for o in c.offsets), tuple(int(z) for z in c.sizes)) for c in self._entry(name).chunks]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The global tensor `name`, or its rows [start, stop) along dim 0, assembled from every chunk."""
        import torch

        entry = self._entry(name)
        size = self.shape(name)
        start, stop = self._rows(name, size, rows)
        out = torch.empty((stop - start, *size[1:]) if size else (), dtype=entry.properties.dtype)
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
        if self._check_finite:
            from glmconv.io.hf_reader import require_finite

            require_finite(out, name, str(self.iter_dir), start)
        return out

    def drop_cache(self) -> None:
        """Forget the last chunk read (kept so that row-by-row reads of one chunk load it once)."""
        self._cache = None

    def _entry(self, name: str) -> Any:
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
        key = (name, tuple(int(o) for o in chunk.offsets))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        self._cache = None
        tensor = self._load(name, chunk)
        self._cache = (key, tensor)
        return tensor

    def _load(self, name: str, chunk: Any) -> torch.Tensor:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self._storage.get(MetadataIndex(name, chunk.offsets))
        if info is None:
            raise CheckpointError(f"{name}: chunk at {list(chunk.offsets)} has no storage entry in {DCP_METADATA_NAME}")
        path = self._data_file(name, info)
        try:
            with open(path, "rb") as fh:  # torch.load reads the chunk in place: no copy of its bytes
                tensor = torch.load(_Slice(fh, int(info.offset), int(info.length)), map_location="cpu",
                                    weights_only=True)
        except OSError as exc:
            raise CheckpointError(f"{path.name}: cannot read {name} ({exc.strerror or exc})") from None
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: {name}: chunk is not a readable tensor ({_line(exc)})") from None
        want = tuple(int(s) for s in chunk.sizes)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != want or tensor.dtype != self._entry(
                name).properties.dtype:
            got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"{path.name}: {name}: chunk holds {got}, metadata says {want}")
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _data_file(self, name: str, info: Any) -> Path:
        rel = str(getattr(info, "relative_path", ""))
        if not rel or PurePosixPath(rel).name != rel:
            raise CheckpointError(f"{name}: data file {rel!r} is outside the checkpoint directory")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{rel}: {name} is stored with transforms {list(info.transform_descriptors)} "
                                  "(compressed checkpoints are not supported)")
        path = self.iter_dir / rel
        if not path.is_file():
            raise CheckpointError(f"{rel}: data file of {name} is missing from {self.iter_dir}")
        return path


class _Slice(io.RawIOBase):
    """The read-only window [offset, offset + length) of an open file, seekable relative to its start."""

    def __init__(self, fh: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self._fh, self._start, self._len = fh, offset, length
        fh.seek(offset)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._fh.tell() - self._start

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: self._len}[whence]
        self._fh.seek(self._start + min(max(base + pos, 0), self._len))
        return self.tell()

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self._len - self.tell())
        return self._fh.readinto(memoryview(buf)[:n]) if n > 0 else 0


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
    """The reason in one line: the weights-only unpickler's own words when it refused something."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)|(Trying to load unsupported GLOBAL [\w.]+)", str(exc))
    if found:
        return "refused by the weights-only unpickler: " + (found.group(1) or found.group(2)).strip()
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
