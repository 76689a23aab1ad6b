"""Move tensor bytes file to file without passing them through Python: the physical limit is `cp`.

A tensor whose bytes are only rearranged (renamed, stacked, concatenated on dim 0) is described as a list of
`Extent`s of its source files and copied in the kernel (`copy_file_range`), the way `cp` copies; where the
kernel refuses (another filesystem, an old kernel), a bounded pread/write loop does the same.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from glmconv.errors import CheckpointError
from glmconv.io.closing import Closing

_FALLBACK_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}
_BUFFER = 16 << 20  # pread/write fallback: bytes per step


@dataclass(frozen=True)
class Extent:
    """Bytes [offset, offset + length) of the file `path`."""

    path: Path
    offset: int
    length: int


def merge(extents: Iterable[Extent]) -> list[Extent]:
    """Adjacent extents of the same file fused, so one syscall copies what the source holds contiguously."""
    out: list[Extent] = []
    for e in extents:
        if e.length == 0:
            continue
        last = out[-1] if out else None
        if last is not None and last.path == e.path and last.offset + last.length == e.offset:
            out[-1] = Extent(e.path, last.offset, last.length + e.length)
        else:
            out.append(e)
    return out


class FileCopier(Closing):
    """Copies extents to an open file or into memory; keeps each source file open once for the copier's life.

    Reads may come from several threads at once (convert's readers share one source): opening is locked.
    """

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._fds: dict[Path, int] = {}
        self._opening = threading.Lock()
        self._kernel_copy = hasattr(os, "copy_file_range")

    def close(self) -> None:
        self._stack.close()
        self._fds.clear()

    def copy(self, extents: Iterable[Extent], dst_fd: int) -> int:
        """Append every extent, in order, at `dst_fd`'s current position; returns the bytes copied."""
        total = 0
        for e in merge(extents):
            self._copy_one(e, dst_fd)
            total += e.length
        return total

    def read_into(self, extents: Iterable[Extent], out: memoryview) -> None:
        """Fill `out` (a writable byte buffer) with the extents' bytes, in order: one copy, no mmap."""
        pos = 0
        for e in merge(extents):
            fd, done = self._fd(e.path), 0
            while done < e.length:
                n = os.preadv(fd, [out[pos + done:pos + e.length]], e.offset + done)
                if n == 0:
                    raise CheckpointError(f"{e.path}: ends before byte {e.offset + done} (truncated?)")
                done += n
            pos += e.length
        if pos != len(out):
            raise CheckpointError(f"read {pos} bytes into a buffer of {len(out)}")

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._opening:
            return self._open(path)

    def _open(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot open ({exc.strerror or exc})") from None
            self._stack.callback(os.close, fd)
            self._fds[path] = fd
        return fd

    def _copy_one(self, e: Extent, dst_fd: int) -> None:
        src, offset, left = self._fd(e.path), e.offset, e.length
        while left and self._kernel_copy:
            try:
                n = os.copy_file_range(src, dst_fd, left, offset)
            except OSError as exc:
                if exc.errno not in _FALLBACK_ERRNOS:
                    raise
                self._kernel_copy = False
                break
            if n == 0:
                raise CheckpointError(f"{e.path}: ends before byte {offset} (truncated while being read?)")
            offset, left = offset + n, left - n
        for chunk in _pread_chunks(src, e.path, offset, left):
            write_all(dst_fd, chunk)


def _pread_chunks(fd: int, path: Path, offset: int, length: int) -> Iterator[bytes]:
    while length:
        data = os.pread(fd, min(length, _BUFFER), offset)
        if not data:
            raise CheckpointError(f"{path}: ends before byte {offset} (truncated while being read?)")
        yield data
        offset, length = offset + len(data), length - len(data)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until every byte is out (a write may be short on a pipe, a signal or a nearly full disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_into(extents: Iterable[Extent], out: memoryview) -> None:
    """Fill `out` (a writable byte buffer) with the extents' bytes, in order: one copy, no mmap."""
    with FileCopier() as files:
        files.read_into(extents, out)
