"""Lazy HF tensor source: one tensor at a time, read with pread; FP8 blocks dequantised on the way out."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from glmconv.defaults import READ_BUFFER_BYTES
from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent, FileCopier
from glmconv.io.closing import Closing
from glmconv.io.dtypes import torch_dtype
from glmconv.io.read_buffers import ReadBuffers
from glmconv.io.safetensors.header import HeaderEntry, SafetensorsHeader, read_header
from glmconv.numerics.finite import require_finite
from glmconv.numerics.fp8 import check_scales, dequantize_fp8_blocks
from glmconv.rules import names
from glmconv.rules.table import FP8

if TYPE_CHECKING:
    import torch

class Dequantize(Protocol):
    """FP8 codes and their block scales to `out_dtype`, into `out` where given (else a new tensor)."""

    def __call__(self, fp8: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor: ...


class HfTensorSource(Closing):
    """Reads named tensors from safetensors shards on demand with pread (no mmap: RSS is what is held).

    Shard headers are read (and validated) once per shard, and each shard is opened once; `entry` tells
    where a tensor's bytes sit so that a writer can copy them file to file without reading them at all.
    `dequantize` (glmconv/numerics/dequant.py: CPU slabs on threads, or the GPU) replaces the reference call with the
    same bits; one with `pinned` set gets FP8 codes read straight into pinned memory. Readable from several
    threads at once.
    """

    def __init__(self, files: dict[str, Path], *, check_finite: bool = True,
                 dequantize: Dequantize | None = None, headers: dict[Path, SafetensorsHeader] | None = None,
                 reuse_buffers: bool = False) -> None:
        """`headers`: the shards' headers as inspecting the checkpoint read them (`HfCheckpoint.headers`);
        `reuse_buffers`: CPU reads land in each thread's `ReadBuffers` (for readers whose tensors are dropped once
        used: not a model's weights, which would hold their buffers for good)."""
        self._files = files
        self._check_finite = check_finite
        self._dequantize = dequantize
        self._headers: dict[Path, SafetensorsHeader] = dict(headers or {})
        self._shards = FileCopier()
        self._buffers = threading.local() if reuse_buffers else None  # each thread's ReadBuffers

    def close(self) -> None:
        self._headers.clear()
        self._shards.close()

    @property
    def check_finite(self) -> bool:
        return self._check_finite

    def entry(self, name: str) -> tuple[HeaderEntry, Extent]:
        """The tensor's header entry and the file bytes that hold it."""
        path = self._files.get(name)
        if path is None:
            raise CheckpointError(f"{name}: not in the checkpoint")
        header = self._headers.get(path)
        if header is None:
            header = self._headers[path] = read_header(path)
        e = header.entries.get(name)
        if e is None:
            raise CheckpointError(f"{name}: not in {path.name} (the index says it is)")
        return e, Extent(path, header.data_start + e.begin, e.end - e.begin)

    def stored_dtype(self, name: str) -> str:
        return self.entry(name)[0].dtype

    def raw(self, name: str, rows: int | tuple[int, int] | None = None, pin: bool = False) -> torch.Tensor:
        """The tensor exactly as stored, or only rows [start, stop) (`rows` alone: the first ones), read alone
        (`pin`: into pinned memory, for a copy to the GPU that overlaps)."""
        e, extent = self.entry(name)
        shape = list(e.shape)
        if rows is not None and shape:
            start, stop = (0, rows) if isinstance(rows, int) else rows
            start, stop = min(max(start, 0), shape[0]), min(max(stop, start), shape[0])
            row_bytes = extent.length // max(shape[0], 1)
            extent = Extent(extent.path, extent.offset + start * row_bytes, row_bytes * (stop - start))
            shape[0] = stop - start
        out = self._empty(extent.length, pin)
        self._shards.read_into([extent], out.numpy().data)
        return out.view(torch_dtype(e.dtype)).reshape(shape)

    def raw_many(self, names: list[str], pin: bool = False) -> list[torch.Tensor]:
        """The tensors exactly as stored, read into one buffer in order (`pin`: pinned): consecutive rows of one
        stack where they share a shape and dtype, so that stacking them copies nothing (`fp8_encode`)."""
        found = [self.entry(n) for n in names]
        out = self._empty(sum(x.length for _, x in found), pin)
        self._shards.read_into([x for _, x in found], out.numpy().data)
        got, at = [], 0
        for e, x in found:
            got.append(out[at:at + x.length].view(torch_dtype(e.dtype)).reshape(list(e.shape)))
            at += x.length
        return got

    def _empty(self, nbytes: int, pin: bool) -> torch.Tensor:
        """A byte buffer for a read: pinned, else this thread's reused one where the source reuses buffers."""
        import torch

        if pin or self._buffers is None:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        buffers: ReadBuffers | None = getattr(self._buffers, "pool", None)
        if buffers is None:
            buffers = self._buffers.pool = ReadBuffers(READ_BUFFER_BYTES)
        return buffers.empty((nbytes,), torch.uint8)

    def weight(self, name: str, out_dtype: torch.dtype, device: torch.device | str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor in `out_dtype`; FP8 weights are dequantised with their `_scale_inv` blocks.

        With `device`, FP8 codes and scales move there first and are dequantised there (a GPU does it ~10x faster
        than the CPU; the product is one fp32 multiply either way, so the bits are the same). `out` (the weight's
        shape, `out_dtype`: a view into a tensor being assembled): filled and returned, the
        dequantizer writing into it directly.
        """
        import torch

        pin = getattr(self._dequantize, "pinned", False) and device is None and self.stored_dtype(name) == FP8
        t = self.raw(name, pin=pin)
        if t.dtype == torch.float8_e4m3fn:
            scale = names.scale_name(name)
            if scale not in self._files:
                raise CheckpointError(f"{name}: FP8 weight without its {scale}")
            scale_inv = self.raw(scale)
            check_scales(scale_inv, f"{scale} ({self._files[scale].name})")
            require_finite(t, name, self._files[name].name)  # NaN codes, always: on every device
            if device is not None:
                t, scale_inv = t.to(device), scale_inv.to(device)
            if self._dequantize is not None and device is None:
                t = self._dequantize(t, scale_inv, out_dtype, out=out)
            else:
                t = dequantize_fp8_blocks(t, scale_inv, out_dtype=out_dtype)
        elif t.dtype != out_dtype:
            t = t.to(out_dtype)
        elif not self._check_finite:
            return _into(out, t)  # the stored values, unchanged (--check-finite also checks these)
        require_finite(t, name, self._files[name].name)  # a dequantised or cast weight may overflow to Inf
        return _into(out, t)


def _into(out: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """`t`, in `out` where one is given (a dequantizer that filled `out` itself returns it: nothing to copy)."""
    if out is None or t is out:
        return t
    return out.copy_(t)
