"""One tensor as a torch.save archive (what a DCP data file holds per item), written straight to a file.

torch itself writes the archive (pickle, zip records, alignment), so torch.load reads it on any version;
two things are changed: no zip CRC-32 (torch.load never checks it; computing it halves the write speed),
and a `FileTensor`, whose bytes already sit in source files, is never read into memory: torch is handed
an untouched placeholder of the right size, and when its data record arrives the kernel copies the
source extents into the file instead (`copy_file_range`).
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent, FileCopier, read_into, write_all
from glmconv.rules.pieces import take

if TYPE_CHECKING:
    import torch


_SMALL = 1 << 16  # writes below this are gathered and flushed together
_DESCRIPTOR_HEAD = 8  # the bytes of a written buffer torch inspects for a zip data descriptor


@dataclass(frozen=True)
class FileTensor:
    """A contiguous tensor whose bytes are `extents` of files, in order; quacks like a tensor where needed."""

    shape: torch.Size
    dtype: torch.dtype
    extents: tuple[Extent, ...]

    def __post_init__(self) -> None:
        if sum(e.length for e in self.extents) != self.nbytes:
            raise CheckpointError(f"extents hold {sum(e.length for e in self.extents)} bytes, a "
                                  f"{list(self.shape)} {self.dtype} tensor needs {self.nbytes}")

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def rows(self, start: int, stop: int) -> FileTensor:
        """Rows [start, stop) along dim 0: the same files' bytes, extents clipped (nothing read)."""
        row = self.nbytes // self.shape[0]
        return FileTensor(type(self.shape)([stop - start, *self.shape[1:]]), self.dtype,
                          tuple(take(self.extents, start * row, stop * row)))

    def materialize(self) -> torch.Tensor:
        """The tensor in memory (tests, and callers that must look at the values)."""
        import torch

        out = torch.empty(self.nbytes, dtype=torch.uint8)
        read_into(self.extents, out.numpy().data)
        return out.view(self.dtype).reshape(self.shape)


@contextlib.contextmanager
def no_crc32() -> Iterator[None]:
    """torch.save without the zip CRC-32 over every byte (torch.load does not verify it)."""
    from torch.utils.serialization import config as serialization_config

    config = serialization_config.save
    old = config.compute_crc32
    config.compute_crc32 = False
    try:
        yield
    finally:
        config.compute_crc32 = old


class _FdSink(io.RawIOBase):
    """The file torch.save writes into: small records gathered, the placeholder's record copied from files."""

    def __init__(self, fd: int, copier: FileCopier, placeholder: tuple[int, int, tuple[Extent, ...]] | None) -> None:
        super().__init__()
        self._fd, self._copier = fd, copier
        self._placeholder = placeholder  # (address, nbytes, extents)
        self._pending = bytearray()
        self.written = 0
        self.substituted = 0
        self.error: CheckpointError | None = None  # what the copy raised: torch turns it into its own error

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self._placeholder is not None and n == self._placeholder[1] and n and _address(view) == self._placeholder[0]:
            self._flush_pending()
            try:
                self._copier.copy(self._placeholder[2], self._fd)
            except CheckpointError as exc:  # e.g. a source file truncated meanwhile: the input is named
                self.error = exc
                raise
            self.substituted += 1
        elif n < _SMALL:
            self._pending += view
        else:
            self._flush_pending()
            write_all(self._fd, view)
        self.written += n
        return n

    def flush(self) -> None:
        self._flush_pending()

    def _flush_pending(self) -> None:
        if self._pending:
            write_all(self._fd, self._pending)
            self._pending = bytearray()


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _placeholder(tensor: FileTensor) -> torch.Tensor:
    """A tensor of `tensor`'s size whose memory is never touched but for its first bytes, set to zero.

    torch hashes bytes 4..8 of every written buffer that starts like a zip data descriptor (`PK\x07\x08`) into
    `.data/serialization_id`; freed memory that held an earlier archive sometimes does, so an uninitialised
    head made the archive's bytes differ from run to run.
    """
    import torch

    raw = torch.empty(tensor.nbytes, dtype=torch.uint8)  # the rest is never touched: no memory is faulted in
    raw[:_DESCRIPTOR_HEAD].zero_()
    return raw.view(tensor.dtype).reshape(tensor.shape)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor `t` (a row of a stacked tensor) over a storage of exactly its bytes, sharing them:
    torch.save writes a view's whole storage, and a copy of each row cost the writer a copy of every byte."""
    import torch

    if t.numel() == 0 or not t.is_contiguous() or t.device.type != "cpu":
        return t.detach().clone()  # its own storage the plain way
    flat = t.detach().reshape(-1).view(torch.uint8).numpy()  # a buffer over the row's bytes, holding its storage
    return torch.frombuffer(flat, dtype=torch.uint8).view(t.dtype).view(t.shape)


def save_tensor(fd: int, tensor: torch.Tensor | FileTensor, copier: FileCopier) -> int:
    """Append `tensor` as a torch.save archive at `fd`'s position; returns the archive's length in bytes."""
    import torch

    if isinstance(tensor, FileTensor):
        placeholder = _placeholder(tensor)
        sink = _FdSink(fd, copier, (placeholder.data_ptr(), tensor.nbytes, tensor.extents))
        data: torch.Tensor = placeholder
    else:
        sink = _FdSink(fd, copier, None)
        data = tensor.detach().contiguous()
    try:
        with no_crc32():
            torch.save(data, sink)  # type: ignore[arg-type]  # a file-like: torch only writes, tells, flushes
    except Exception:
        if sink.error is not None:
            raise sink.error from None  # the copy's own error, not torch's "unexpected pos" about the output
        raise
    sink.flush()
    if isinstance(tensor, FileTensor) and tensor.nbytes and sink.substituted != 1:
        # torch changed how it writes storages: refuse rather than write the placeholder's garbage
        raise CheckpointError(f"internal: torch.save wrote the {list(tensor.shape)} {tensor.dtype} data record "
                              f"{sink.substituted} times where 1 was expected; this torch version is unsupported")
    return sink.written
