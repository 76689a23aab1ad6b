"""Stored (uncompressed) records of a zip archive, located by hand: where a torch.save archive keeps a tensor's
bytes, so they can be copied or checked without unpacking the archive."""

from __future__ import annotations

import struct
import zipfile
from typing import Any

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_SIGNATURE = 0x04034B50


def record_start(fh: Any, offset: int, length: int, info: zipfile.ZipInfo) -> int | None:
    """Absolute file offset of a stored record's data: after its local header, its name and its extra field."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size or info.flag_bits & 1:
        return None  # compressed or encrypted
    fh.seek(offset + info.header_offset)
    head = fh.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size:
        return None
    sig, _, flags, method, _, _, _, _, _, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if sig != _LOCAL_SIGNATURE or method != zipfile.ZIP_STORED or flags & 1:
        return None
    if fh.read(name_len) != info.filename.encode("utf-8" if flags & 0x800 else "cp437"):
        return None
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > length:
        return None
    return int(offset + start)


def stored_record(fh: Any, offset: int, length: int, info: zipfile.ZipInfo, limit: int) -> bytes | None:
    """A small stored record's bytes (no CRC check: torch.load does none, and writers may leave it 0)."""
    if info.file_size > limit:
        return None
    start = record_start(fh, offset, length, info)
    if start is None:
        return None
    fh.seek(start)
    data = fh.read(info.file_size)
    return data if len(data) == info.file_size else None
