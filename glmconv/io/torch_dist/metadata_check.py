"""A DCP `.metadata` checked field by field right after unpickling: a damaged or hand-made file is one error
line naming what is wrong, never an AttributeError or TypeError deep inside a reader.

What is checked is what glmconv's readers use: every state_dict entry (tensor: dtype, size, chunks of matching
rank; or bytes) and every storage entry (index -> data file name, offset and length as non-negative ints).
The checks hold for the real classes and for their `StandIn`s alike (`safe_unpickle.is_a`): no torch needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.torch_dist.dcp_classes import origin_of
from glmconv.io.torch_dist.safe_unpickle import is_a, is_dtype, safe_load

_MISSING = object()


def load_metadata(path: Path, *, stand_ins: bool = False) -> Any:
    """`.metadata` unpickled through the allow-list (`safe_unpickle`; `stand_ins`: as `StandIn`s, without torch)
    and checked (`check_metadata`)."""
    return check_metadata(safe_load(path, stand_ins=stand_ins), path.name)


def check_metadata(md: Any, source: str) -> Any:
    """`md` when it is a well-formed DCP Metadata; else a CheckpointError naming `source` and the first fault."""
    if not is_a(md, "Metadata"):
        raise CheckpointError(f"{source}: holds a {_kind(md)}, not DCP Metadata")
    entries = _field(md, "state_dict_metadata", dict, source)
    for key, entry in entries.items():
        _check_entry(key, entry, source)
    storage = _field(md, "storage_data", (dict, type(None)), source)
    for index, info in (storage or {}).items():
        _check_storage(index, info, source)
    return md


def _check_entry(key: Any, entry: Any, source: str) -> None:
    if not isinstance(key, str):
        raise CheckpointError(f"{source}: a state_dict key is a {_kind(key)}, expected a string")
    if is_a(entry, "BytesStorageMetadata"):
        return
    if not is_a(entry, "TensorStorageMetadata"):
        raise CheckpointError(f"{source}: entry {key} has unknown storage type {_kind(entry)}")
    where = f"{source}: {key}"
    _dtype(_field(entry, "properties", object, where), where)
    size = _ints(_field(entry, "size", object, where), f"{where}: size")
    for chunk in _field(entry, "chunks", list, where):
        _check_chunk(chunk, len(size), where)


def _dtype(properties: Any, where: str) -> None:
    if not is_a(properties, "TensorProperties"):
        raise CheckpointError(f"{where}: properties is a {_kind(properties)}, expected TensorProperties")
    dtype = _field(properties, "dtype", object, where)
    if not is_dtype(dtype):
        raise CheckpointError(f"{where}: dtype is a {_kind(dtype)}, expected dtype")


def _check_chunk(chunk: Any, rank: int, where: str) -> None:
    if not is_a(chunk, "ChunkStorageMetadata"):
        raise CheckpointError(f"{where}: a chunk is a {_kind(chunk)}, expected ChunkStorageMetadata")
    for name in ("offsets", "sizes"):
        got = _ints(_field(chunk, name, object, where), f"{where}: chunk {name}")
        if len(got) != rank:
            raise CheckpointError(f"{where}: chunk {name} {list(got)} do not match the tensor's {rank} dims")


def _check_storage(index: Any, info: Any, source: str) -> None:
    if not is_a(index, "MetadataIndex"):
        raise CheckpointError(f"{source}: a storage_data key is a {_kind(index)}, expected MetadataIndex")
    fqn = _field(index, "fqn", str, f"{source}: storage_data key")
    where = f"{source}: storage of {fqn}"
    offset = _field(index, "offset", object, where)
    if offset is not None:
        _ints(offset, f"{where}: index offset")
    if not is_a(info, "_StorageInfo"):
        raise CheckpointError(f"{where} is a {_kind(info)}, expected _StorageInfo")
    _field(info, "relative_path", str, where)
    for name in ("offset", "length"):
        _ints([_field(info, name, int, where)], f"{where}: {name}")
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None and not isinstance(descriptors, Sequence):
        raise CheckpointError(f"{where}: transform_descriptors is a {_kind(descriptors)}, expected a list")


def _field(obj: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """`obj.name`, which must exist and be a `kind`."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise CheckpointError(f"{where}: {_kind(obj)} has no {name}")
    if not isinstance(value, kind) or isinstance(value, bool):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CheckpointError(f"{where}: {name} is a {_kind(value)}, expected {want}")
    return value


def _ints(values: Any, where: str) -> tuple[int, ...]:
    """`values` as a tuple of non-negative ints (a torch.Size, tuple or list of them)."""
    if not isinstance(values, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{where}: expected non-negative integers, got {_short(values)}")
    return tuple(values)


def _kind(obj: Any) -> str:
    """`obj`'s class name as DCP names it: a stand-in by the class it stands in for."""
    origin = origin_of(type(obj))
    return origin[1] if origin else type(obj).__name__


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, (int, str, list, tuple, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."
