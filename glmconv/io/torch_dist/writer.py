"""Write a Megatron-core torch_dist checkpoint of GLOBAL tensors in torch.distributed.checkpoint's (DCP) format.

Design (docs/torch_dist.md has the evidence): DCP cannot append to a checkpoint, so every group of
tensors is written as one data file `__{rank}_{i}.distcp` laid out exactly as `dcp.save` lays it out (one
torch.save archive per item, see `torch_save`; tensors already in files are copied by the kernel); the
group's metadata is kept (a few hundred bytes per tensor) and the tensors are released. At `finish()` the
ranks' metadata are gathered on the coordinator, merged, checked (every tensor tiled exactly once, as planned)
and written as `.metadata` exactly as DCP's `FileSystemWriter.finish` writes it (`_write_dcp_metadata`), from
stand-ins of DCP's classes (`dcp_classes`): importing DCP's package costs 0.6-0.9 s. Then `metadata.json`, and
the tracker file last; every file is created O_EXCL|O_NOFOLLOW, like every file glmconv writes. Tensors that no
trainer loads (`kept`: glmconv's `glmconv_kept.` names) go to data files and a `.metadata` of their own in the
`glmconv_kept/` subdirectory, so a strict load (`raise_all`) sees only what the trainer requests; glmconv's
reader merges the two (`metadata.inspect_torch_dist`). Peak memory
is one group. Each data file is fsynced on a background thread as soon as it is complete
(glmconv/io/background_sync.py), so the disk flushes while the next group is written; `finish` waits for all
of them before it writes any metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from glmconv.errors import CheckpointError
from glmconv.io.background_sync import BackgroundSync
from glmconv.io.byte_copy import FileCopier, write_all
from glmconv.io.dtypes import torch_dtype
from glmconv.io.file_names import (
    COMMON_STATE_KEY,
    DCP_METADATA_NAME,
    KEPT_DIR,
    MCORE_METADATA_NAME,
    RELEASE,
    TRACKER_NAME,
)
from glmconv.io.output import new_file
from glmconv.io.torch_dist.common_state import pickle_module_for
from glmconv.io.torch_dist.dcp_classes import (
    CURRENT_DCP_VERSION,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    dumps,
)
from glmconv.io.torch_dist.metadata import TORCH_DIST
from glmconv.io.torch_dist.torch_save import FileTensor, own_storage, save_tensor

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch
    import torch.distributed as dist

    _Entry: TypeAlias = TensorStorageMetadata | BytesStorageMetadata
    _Part: TypeAlias = tuple[dict[str, _Entry], dict[MetadataIndex, StorageInfo], str | None]

BACKEND_CONFIG = {"sharded_backend": TORCH_DIST, "sharded_backend_version": 1}
_OBJECT_KEY = re.compile(r"^[^/]+/shard_\d+(\.\d+)*_\d+(\.\d+)*$")


class Planned(Protocol):
    """What a written tensor is checked against: the plan's shape and dtype code (`glmconv.plan.TensorSpec`)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...


@dataclass(frozen=True)
class Chunk:
    """Rows [row, row + len(tensor)) along dim 0 of the global tensor `name` of `shape` (None: whole)."""

    name: str
    tensor: torch.Tensor | FileTensor
    row: int = 0
    shape: tuple[int, ...] | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape) if self.shape is None else tuple(self.shape)

    @property
    def offsets(self) -> torch.Size:
        import torch

        return torch.Size([self.row] + [0] * (self.tensor.dim() - 1)) if self.tensor.dim() else torch.Size([])

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def per_row(self) -> list[Chunk]:
        """A stacked tensor's rows (experts) one chunk each, as Megatron's own saves store them (each expert its own
        ShardedTensor): torch's FileSystemReader loads a whole stored chunk for every expert a trainer requests
        (filesystem.py `read_data`: torch.load of the item, then narrow), so a chunk of k experts is read k times."""
        if self.shape is None or self.tensor.dim() == 0 or self.tensor.shape[0] <= 1:
            return [self]
        t = self.tensor  # a row over its own bytes alone: torch.save writes a view's whole storage
        return [Chunk(self.name, t.rows(i, i + 1) if isinstance(t, FileTensor) else own_storage(t[i:i + 1]),
                      self.row + i, self.shape) for i in range(t.shape[0])]

    @property
    def completes(self) -> bool:
        """This chunk holds the global tensor's last rows (a whole tensor always does)."""
        rows = self.tensor.shape[0] if self.tensor.dim() else 1
        return not self.global_shape or self.row + rows >= self.global_shape[0]


def stacked_chunks(name: str, shape: tuple[int, ...], rows: Iterable[torch.Tensor], per: int = 1) -> Iterator[Chunk]:
    """Stack per-row tensors (one expert each) into dim-0 chunks of `per` rows; the whole is never built."""
    import torch

    batch: list[torch.Tensor] = []
    start = 0
    for t in rows:
        batch.append(t)
        if len(batch) == per:
            yield Chunk(name, torch.stack(batch), row=start, shape=shape)
            start, batch = start + per, []
    if batch:
        yield Chunk(name, torch.stack(batch), row=start, shape=shape)


def empty_extra_state() -> torch.Tensor:
    """What a BF16 Transformer-Engine module saves as `_extra_state` ("no FP8"); every layer type accepts it."""
    import torch

    return torch.empty(0, dtype=torch.uint8)


def _tensor_entry(c: Chunk) -> TensorStorageMetadata:
    """DCP's metadata of one chunk, as `dcp.save` would record it for a contiguous CPU tensor."""
    import torch

    return TensorStorageMetadata(
        properties=TensorProperties(dtype=c.tensor.dtype), size=torch.Size(c.global_shape),
        chunks=[ChunkStorageMetadata(offsets=c.offsets, sizes=torch.Size(c.tensor.shape))])


def _write_group_file(path: Path, final: str, chunks: list[Chunk], objects: Mapping[str, io.BytesIO],
                      progress: Any = None) -> tuple[dict[str, _Entry], dict[MetadataIndex, StorageInfo]]:
    """One DCP data file as `dcp.save` lays it out (objects, then one torch.save archive per chunk).

    `progress` (glmconv.progress) counts each chunk's bytes once written, a tensor once its last rows are.
    """
    md: dict[str, _Entry] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    pos = 0
    with new_file(path, "wb", buffering=0) as f, FileCopier() as copier:
        for key, buf in objects.items():
            data = buf.getbuffer()
            write_all(f.fileno(), data)
            md[key], storage[MetadataIndex(key)] = BytesStorageMetadata(), StorageInfo(final, pos, data.nbytes)
            pos += data.nbytes
        for c in chunks:
            n = save_tensor(f.fileno(), c.tensor, copier)
            if progress is not None:
                progress.advance(c.nbytes, int(c.completes))
            storage[MetadataIndex(c.name, c.offsets)] = StorageInfo(final, pos, n)
            pos += n
            error = _merge(md, {}, {c.name: _tensor_entry(c)}, {})
            if error:
                raise CheckpointError(error)
    return md, storage


class DcpWriter:
    """Writes `<root>/release` group by group; `finish()` publishes it (collective when `group` is given)."""

    def __init__(self, root: str | Path, *, specs: Mapping[str, Planned] | None = None,
                 group: dist.ProcessGroup | None = None, sync_files: bool = True, progress: Any = None,
                 kept: Callable[[str], bool] | None = None) -> None:
        import torch.distributed as dist

        self.root, self.ckpt_dir = Path(root), Path(root) / RELEASE
        self._specs, self._group, self._sync, self._progress = specs, group, sync_files, progress
        self._kept = kept or (lambda name: False)  # tensors written to the KEPT_DIR sidecar
        self.rank = dist.get_rank() if group is not None else 0
        self.coordinator = dist.get_global_rank(group, 0) if group is not None else 0
        self._md: dict[str, _Entry] = {}
        self._storage: dict[MetadataIndex, StorageInfo] = {}
        self._groups = 0
        self._failed: str | None = None  # a rank that failed still calls finish(), which then publishes nothing
        self._done = False
        self._syncer = BackgroundSync()
        self._raise(self._broadcast(self._prepare_dirs() if self.is_coordinator else None))
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    @property
    def groups_written(self) -> int:
        return self._groups

    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """One group of whole tensors, one data file."""
        self.write_chunks([Chunk(name, t) for name, t in tensors.items()])

    def write_chunks(self, chunks: Iterable[Chunk]) -> None:
        """One group of chunks (whole tensors or dim-0 row ranges, stored a row each), one data file."""
        chunks = [row for c in chunks for row in c.per_row()]
        with self._recording():
            for c in chunks:
                self._check_chunk(c)
            if len({(c.name, c.row) for c in chunks}) != len(chunks):
                raise CheckpointError("a group holds the same chunk twice")
            self._save_group(chunks, {})

    def write_stream(self, chunks: Iterable[Chunk], group_bytes: int) -> int:
        """Write chunks as they come, one group per `group_bytes`: memory stays at one group plus one chunk."""
        pending: list[Chunk] = []
        size, groups = 0, 0
        queued = getattr(self._progress, "queued", None)  # the bar's ETA learns how long a group takes to fill
        for c in chunks:
            pending.append(c)
            size += c.nbytes
            if queued is not None:
                queued(c.nbytes)
            if size >= group_bytes:
                self.write_chunks(pending)
                pending, size, groups = [], 0, groups + 1
        if pending:
            self.write_chunks(pending)
            groups += 1
        return groups

    def write_objects(self, objects: Mapping[str, Any]) -> None:
        """Megatron ShardedObjects (e.g. `_extra_state`) by unique key, stored as megatron does: torch.save([obj])."""
        with self._recording():
            for key in objects:
                if not _OBJECT_KEY.match(key):
                    raise CheckpointError(f"{key!r} is not a ShardedObject key (<key>/shard_<offset>_<shape>)")
            self._save_group([], {key: _serialize(obj) for key, obj in objects.items()})

    def finish(self, common_state: Mapping[str, Any] | None = None) -> Path:
        """Coordinator adds the common state, merges every rank's metadata, checks it, publishes; all ranks call."""
        if self._done:
            raise CheckpointError(f"{self.ckpt_dir}: finish() was already called")
        if self.is_coordinator and self._failed is None:
            try:
                if common_state is None:
                    raise CheckpointError("the coordinator must pass the common state to finish()")
                self.write_objects({COMMON_STATE_KEY: dict(common_state)})
            except CheckpointError:
                pass  # recorded in self._failed
        self._wait_for_disk()
        error, self._done = self._failed, True
        parts = self._gather((self._md, self._storage, error))
        if self.is_coordinator:
            error = self._publish(parts)
        self._raise(self._broadcast(error))
        return self.ckpt_dir

    def _wait_for_disk(self) -> None:
        """Every data file of this rank fsynced (when syncing) before any metadata names it."""
        try:
            if self._failed is None:
                self._syncer.wait()
        except CheckpointError as exc:
            self._failed = str(exc)
        finally:
            self._syncer.close()

    def _prepare_dirs(self) -> str | None:
        if (self.root / TRACKER_NAME).exists():
            return f"{self.root} already holds a published checkpoint ({TRACKER_NAME}); choose an empty directory"
        try:
            if self.ckpt_dir.exists() and any(self.ckpt_dir.iterdir()):
                return f"{self.ckpt_dir} is not empty (an interrupted run?); remove it first"
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"{self.ckpt_dir}: cannot create the checkpoint directory ({exc.strerror or exc})"
        return None

    def _check_chunk(self, c: Chunk) -> None:
        shape, t = c.global_shape, c.tensor
        if t.dim() != len(shape) or tuple(t.shape[1:]) != shape[1:] or c.row < 0 or t.numel() == 0:
            raise CheckpointError(f"{c.name}: chunk {list(t.shape)} at row {c.row} does not fit {list(shape)}")
        if t.dim() and c.row + t.shape[0] > shape[0] or not t.dim() and c.row:
            raise CheckpointError(f"{c.name}: chunk rows {c.row}..{c.row + t.shape[0]} exceed {shape[0]}")
        if self._specs is None:
            return
        spec = self._specs.get(c.name)
        if spec is None:
            raise CheckpointError(f"{c.name}: not a tensor of the plan")
        if tuple(spec.shape) != shape or torch_dtype(spec.dtype) != t.dtype:
            raise CheckpointError(
                f"{c.name}: {list(shape)} {t.dtype} but the plan says {list(spec.shape)} {spec.dtype}")

    def _save_group(self, chunks: list[Chunk], objects: dict[str, io.BytesIO]) -> None:
        if self._done:
            raise CheckpointError(f"{self.ckpt_dir}: already finished; nothing more can be written")
        kept = [c for c in chunks if self._kept(c.name)]
        self._save_file(self.ckpt_dir, [c for c in chunks if not self._kept(c.name)], objects)
        if kept:
            (self.ckpt_dir / KEPT_DIR).mkdir(exist_ok=True)
            self._save_file(self.ckpt_dir / KEPT_DIR, kept, {})

    def _save_file(self, folder: Path, chunks: list[Chunk], objects: dict[str, io.BytesIO]) -> None:
        """One data file in `folder` (the iteration directory or its KEPT_DIR), named relative to the former."""
        if not chunks and not objects:
            return
        name = f"__{self.rank}_{self._groups}.distcp"
        final, tmp = str((folder / name).relative_to(self.ckpt_dir)), folder / f".part{name}"
        try:
            md, infos = _write_group_file(tmp, final, chunks, objects, self._progress)
            os.replace(tmp, folder / name)
            if self._sync:
                self._syncer.submit(folder / name)
        except CheckpointError:
            tmp.unlink(missing_ok=True)
            raise
        except Exception as exc:
            tmp.unlink(missing_ok=True)
            need = sum(c.nbytes for c in chunks) + sum(len(b.getvalue()) for b in objects.values())
            why = _why(exc, folder, need)
            raise CheckpointError(f"{folder / name}: write failed ({why})") from None
        self._groups += 1
        self._raise(_merge(self._md, self._storage, md, infos))

    def _publish(self, parts: list[_Part]) -> str | None:
        md: dict[str, _Entry] = {}
        storage: dict[MetadataIndex, StorageInfo] = {}
        errors = [err for _, _, err in parts if err]
        errors += [e for part_md, part_st, _ in parts if (e := _merge(md, storage, part_md, part_st))]
        errors += [e for name, entry in md.items() if (e := _check_tiling(name, entry))]
        errors += _check_specs(md, self._specs)
        if errors:
            return errors[0] if len(errors) == 1 else f"{errors[0]} (and {len(errors) - 1} more problems)"
        kept = {k for k in md if self._kept(k)}
        try:
            if kept:  # the sidecar's own `.metadata`, its data files named relative to it, before the main one
                _write_dcp_metadata(self.ckpt_dir / KEPT_DIR, _metadata(md, kept), {
                    MetadataIndex(k.fqn, k.offset): dataclasses.replace(v, relative_path=_in_kept(v.relative_path))
                    for k, v in storage.items() if k.fqn in kept}, self._sync, f"{RELEASE}/{KEPT_DIR}")
            _write_dcp_metadata(self.ckpt_dir, _metadata(md, md.keys() - kept),
                                {k: v for k, v in storage.items() if k.fqn not in kept}, self._sync, RELEASE)
            _write_text(self.ckpt_dir / MCORE_METADATA_NAME, json.dumps(BACKEND_CONFIG), self._sync)
            _write_text(self.root / TRACKER_NAME, RELEASE, self._sync)  # last: the success signal
        except OSError as exc:
            return f"{self.ckpt_dir}: cannot publish the checkpoint ({exc.strerror or exc})"
        return None

    def _gather(self, part: _Part) -> list[_Part]:
        import torch.distributed as dist

        if self._group is None:
            return [part]
        out: list[Any] | None = [None] * dist.get_world_size(self._group) if self.is_coordinator else None
        dist.gather_object(part, out, dst=self.coordinator, group=self._group)
        return out or []

    def _broadcast(self, value: str | None) -> str | None:
        import torch.distributed as dist

        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.coordinator, group=self._group)
        return box[0]

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        try:
            yield
        except CheckpointError as exc:
            self._failed = self._failed or str(exc)
            raise

    @staticmethod
    def _raise(error: str | None) -> None:
        if error:
            raise CheckpointError(error)


def _metadata(md: Mapping[str, _Entry], keys: Iterable[str]) -> Metadata:
    return Metadata(state_dict_metadata={k: md[k] for k in sorted(keys)})


def _in_kept(relative_path: str) -> str:
    """A sidecar data file's name relative to the sidecar (`_save_file` names it relative to the iteration dir)."""
    return relative_path.removeprefix(f"{KEPT_DIR}/")


def _why(exc: BaseException, where: Path, need: int) -> str:
    """One line on why a group write failed; torch's zip writer reports a full disk only as a short write."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    if free is not None and free < need:
        return f"No space left on device: {free:,} bytes free, the group needs {need:,}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _serialize(obj: Any) -> io.BytesIO:
    import torch

    buf = io.BytesIO()
    torch.save([obj], buf, pickle_module=pickle_module_for(obj))
    buf.seek(0)
    return buf


def _merge(md: dict[str, _Entry], storage: dict[MetadataIndex, StorageInfo], part_md: Mapping[str, _Entry],
           part_storage: Mapping[MetadataIndex, StorageInfo]) -> str | None:
    """Fold one group's (or rank's) metadata into `md`: chunks of the same tensor accumulate."""
    for name, entry in part_md.items():
        have = md.get(name)
        if have is None:
            md[name] = (dataclasses.replace(entry, chunks=list(entry.chunks))
                        if isinstance(entry, TensorStorageMetadata) else entry)
        elif not isinstance(have, TensorStorageMetadata) or not isinstance(entry, TensorStorageMetadata):
            return f"{name}: written twice"
        elif have.size != entry.size or have.properties.dtype != entry.properties.dtype:
            return f"{name}: chunks disagree on shape or dtype ({list(have.size)} vs {list(entry.size)})"
        else:
            have.chunks.extend(entry.chunks)
    twice = [k for k in part_storage if k in storage]
    if twice:
        return f"{twice[0].fqn}: chunk at {list(twice[0].offset or [])} written twice"
    storage.update(part_storage)
    return None


def _check_tiling(name: str, entry: _Entry) -> str | None:
    """A tensor's chunks must cover its rows exactly once (chunks only ever split dim 0)."""
    if not isinstance(entry, TensorStorageMetadata):
        return None
    size = tuple(entry.size)
    entry.chunks.sort(key=lambda c: tuple(c.offsets))
    if not size:
        return None if len(entry.chunks) == 1 else f"{name}: scalar written {len(entry.chunks)} times"
    row = 0
    for c in entry.chunks:
        off, sz = tuple(c.offsets), tuple(c.sizes)
        if off[0] != row or any(off[1:]) or sz[1:] != size[1:]:
            return f"{name}: chunks overlap or leave a gap at row {row} of {size[0]}"
        row += sz[0]
    return None if row == size[0] else f"{name}: rows {row}..{size[0]} were never written"


def _check_specs(md: Mapping[str, _Entry], specs: Mapping[str, Planned] | None) -> list[str]:
    if specs is None:
        return []
    names = {k for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
    missing, unexpected = sorted(set(specs) - names), sorted(names - set(specs))
    errors = [f"{len(missing)} planned tensors were never written, e.g. {missing[0]}"] if missing else []
    errors += [f"{len(unexpected)} tensors are not in the plan, e.g. {unexpected[0]}"] if unexpected else []
    for name in sorted(names & set(specs)):
        entry, spec = md[name], specs[name]
        assert isinstance(entry, TensorStorageMetadata)
        if tuple(entry.size) != tuple(spec.shape) or entry.properties.dtype != torch_dtype(spec.dtype):
            errors.append(f"{name}: written {list(entry.size)} {entry.properties.dtype}, planned "
                          f"{list(spec.shape)} {spec.dtype}")
    return errors


def _write_dcp_metadata(ckpt_dir: Path, md: Metadata, storage: Mapping[MetadataIndex, StorageInfo],
                        sync: bool, checkpoint_id: str) -> None:
    """`.metadata` as torch 2.13's `FileSystemWriter(ckpt_dir, sync_files=sync).finish(md, results)` writes it:
    version, storage_data and storage_meta set, pickled into `.metadata.tmp`, fsynced, renamed over `.metadata`.

    But for `storage_meta`, so that a re-run writes the same bytes (issue 39): DCP records the directory it saved
    to and a random uuid4 there, and no loader reads either (torch's `FileSystemReader.read_metadata` only sets
    `load_id`; megatron-core reads `state_dict_metadata` and `storage_data`). `checkpoint_id` is the directory
    relative to the checkpoint root (`release`, `release/glmconv_kept`), not the staging directory that publishing
    removes, and `save_id` a uuid5 of the sha256 of the metadata itself: the same checkpoint always gets the same
    one, another checkpoint another.
    """
    md.version = CURRENT_DCP_VERSION
    # index hints were per group; drop them (megatron's own saves carry none either)
    md.storage_data = {MetadataIndex(k.fqn, k.offset): v for k, v in storage.items()}
    md.storage_meta = StorageMeta(checkpoint_id=checkpoint_id)
    md.storage_meta.save_id = content_save_id(dumps(md))
    tmp = ckpt_dir / (DCP_METADATA_NAME + ".tmp")
    with new_file(tmp, "wb") as f:
        f.write(dumps(md))
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / DCP_METADATA_NAME)


SAVE_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "glmconv:dcp-save-id")


def content_save_id(metadata: bytes) -> str:
    """A DCP `save_id` (a uuid, as `_generate_uuid` writes it) derived from the pickled metadata, save_id unset."""
    return str(uuid.uuid5(SAVE_ID_NAMESPACE, hashlib.sha256(metadata).hexdigest()))


def _write_text(path: Path, text: str, sync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with new_file(tmp, "w") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
