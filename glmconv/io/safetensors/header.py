"""Read and validate a .safetensors header without touching tensor data (no torch, no mmap)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from glmconv.errors import CheckpointError
from glmconv.io.dtypes import DTYPE_SIZES
from glmconv.io.jsonfile import parse_json
from glmconv.text import show

MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as its shard header describes it; offsets are relative to the data section."""

    name: str
    dtype: str  # safetensors' spelling: BF16, F8_E4M3, ...
    shape: tuple[int, ...]
    begin: int
    end: int  # exclusive


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: tensors in file order, user metadata, and where the data section starts."""

    path: Path
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int
    has_metadata: bool  # a `__metadata__` entry is stored (an empty one too): --like's header written again keeps it


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read and validate `path`'s header; any inconsistency is a CheckpointError naming the file."""
    p = Path(path)
    try:
        size = os.path.getsize(p)
        with open(p, "rb") as fh:
            prefix = fh.read(8)
            n = _header_length(p, prefix, size)
            raw = fh.read(n)
    except OSError as exc:
        raise CheckpointError(f"{show(p.name)}: cannot read ({exc.strerror or exc})") from None
    header = _parse_json(p, raw)
    has_metadata = METADATA_KEY in header
    metadata = _metadata(p, header.pop(METADATA_KEY, None))
    for text in (*header, *metadata, *metadata.values()):
        _check_unicode(p, text)
    entries = {name: _entry(p, name, value) for name, value in header.items()}
    _check_layout(p, entries, size - 8 - n)
    return SafetensorsHeader(path=p, entries=entries, metadata=metadata, data_start=8 + n, has_metadata=has_metadata)


def _header_length(p: Path, prefix: bytes, size: int) -> int:
    if len(prefix) < 8:
        raise CheckpointError(f"{show(p.name)}: truncated: {size} bytes, too short for a safetensors header")
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{show(p.name)}: corrupt header: header length {n} exceeds 100 MB")
    if n > size - 8:
        raise CheckpointError(f"{show(p.name)}: truncated: header says {n} bytes of header, file has {size - 8}")
    return n


def _parse_json(p: Path, raw: bytes) -> dict[str, Any]:
    header = parse_json(raw, show(p.name), what="corrupt header: not valid UTF-8 JSON")
    if not isinstance(header, dict):
        raise CheckpointError(f"{show(p.name)}: corrupt header: expected a JSON object, got {type(header).__name__}")
    return header


def _check_unicode(p: Path, text: str) -> None:
    """JSON may escape a lone surrogate (`\\ud800`); Python accepts it, the safetensors library does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(f"{show(p.name)}: corrupt header: {show(text)} is not valid Unicode "
                              "(a lone surrogate)") from None


def _metadata(p: Path, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CheckpointError(f"{show(p.name)}: corrupt header: __metadata__ must map strings to strings")
    return value


def _is_uint(x: Any) -> bool:
    return type(x) is int and x >= 0  # not bool


def _entry(p: Path, name: str, value: Any) -> HeaderEntry:
    """One header entry, checked; the fast path matters (76,108 entries in the release)."""
    if type(value) is not dict or "dtype" not in value or "shape" not in value or "data_offsets" not in value:
        _corrupt(p, name, "expected an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if size is None:
        _corrupt(p, name, f"unknown dtype {dtype!r}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        _corrupt(p, name, f"shape must be a list of non-negative integers, got {shape!r}")
    if not (type(offsets) is list and len(offsets) == 2 and _is_uint(offsets[0]) and _is_uint(offsets[1])
            and offsets[0] <= offsets[1]):
        _corrupt(p, name, f"data_offsets must be [begin, end] with begin <= end, got {offsets!r}")
    expected = math.prod(shape) * size
    if offsets[1] - offsets[0] != expected:
        _corrupt(p, name, f"{dtype}{shape} needs {expected} bytes, data_offsets span {offsets[1] - offsets[0]}")
    return HeaderEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _corrupt(p: Path, name: str, what: str) -> NoReturn:
    raise CheckpointError(f"{show(p.name)}: corrupt header: tensor {show(name)}: {what}")


def _check_layout(p: Path, entries: dict[str, HeaderEntry], data_len: int) -> None:
    """Tensors must tile the data section exactly: contiguous, non-overlapping, ending at EOF."""
    pos = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            what = "overlaps the previous tensor" if e.begin < pos else f"leaves a gap of {e.begin - pos} bytes"
            raise CheckpointError(f"{show(p.name)}: corrupt header: tensor {show(e.name)} at data offset {e.begin} "
                                  f"{what} (expected offset {pos})")
        pos = e.end
    if pos > data_len:
        raise CheckpointError(f"{show(p.name)}: truncated: header says {pos} bytes of data, file has {data_len}")
    if pos < data_len:
        raise CheckpointError(f"{show(p.name)}: corrupt: header says {pos} bytes of data, file has {data_len}")
