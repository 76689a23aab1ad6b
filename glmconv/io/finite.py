"""NaN and Inf in bytes that are only copied (the zero-copy paths): scanned as raw integers as they pass, with
the same message as `glmconv.numerics.finite.require_finite` gives a tensor."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent
from glmconv.numerics.finite import NON_FINITE_BITS, NonFiniteError, block_of

if TYPE_CHECKING:
    import torch


_SCAN_BYTES = 1 << 24  # scanned a window at a time: memory stays at a few windows whatever the tensor


def require_finite_extents(extents: Sequence[Extent], dtype: torch.dtype, shape: tuple[int, ...], name: str,
                           where: str, row0: int = 0) -> None:
    """`require_finite` for a tensor whose bytes are `extents` of files, in C order, never loaded as a tensor:
    each window viewed as integers, a value non-finite where its exponent bits are all ones (`NON_FINITE_BITS`;
    FP8: its NaN codes). `row0`: the first row of `shape` in its tensor, when the extents hold a run of its rows."""

    bits = _exponent_bits(dtype)
    if bits is None:
        return
    first, count, done = -1, 0, 0
    for e in extents:
        local, n = _scan(e, *bits)
        if n and first < 0:
            first = done + local
        count += n
        done += e.length // dtype.itemsize
    if count:
        _refuse_at(first, count, extents, dtype, shape, name, where, row0)


def _exponent_bits(dtype: torch.dtype) -> tuple[Any, int, int] | None:
    """(numpy unsigned type of the dtype's width, magnitude bits, smallest non-finite magnitude), or None."""
    import numpy as np

    bits = NON_FINITE_BITS.get(str(dtype).removeprefix("torch."))
    if bits is None:
        return None
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize], *bits


def _scan(e: Extent, ints: Any, magnitude: int, least: int) -> tuple[int, int]:
    """(first non-finite element, count) in one extent, read a window at a time with pread (a file truncated under
    the scan is a one-line error, where a memory mapping would fault); a window is counted only when its largest
    magnitude says it holds a bad value."""
    import numpy as np

    first, count = -1, 0
    window = bytearray(min(_SCAN_BYTES, e.length))
    scratch = np.empty(len(window) // np.dtype(ints).itemsize, dtype=ints)
    with open(e.path, "rb", buffering=0) as fh:
        for at in range(0, e.length, _SCAN_BYTES):
            n = min(_SCAN_BYTES, e.length - at)
            _read_exact(fh.fileno(), memoryview(window)[:n], e.offset + at, e.path)
            words = np.frombuffer(window, dtype=np.uint8, count=n).view(ints)
            sign_cleared = np.bitwise_and(words, ints(magnitude), out=scratch[:len(words)])
            if n and int(sign_cleared.max()) >= least:
                bad = sign_cleared >= ints(least)
                if first < 0:
                    first = at // words.itemsize + int(np.argmax(bad))
                count += int(np.count_nonzero(bad))
            del words  # the window is reused: no view of it outlives a step
    return first, count


def _read_exact(fd: int, into: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise CheckpointError(f"{path}: ends before byte {offset + len(into)} (truncated while being read?)")
        done += got


def _refuse_at(first: int, count: int, extents: Sequence[Extent], dtype: torch.dtype, shape: tuple[int, ...],
               name: str, where: str, row0: int) -> None:
    import torch

    size = dtype.itemsize
    at = first * size
    for e in extents:
        if at < e.length:
            with open(e.path, "rb") as fh:
                fh.seek(e.offset + at)
                value = torch.frombuffer(bytearray(fh.read(size)), dtype=dtype)
            break
        at -= e.length
    index = [int(i) for i in torch.unravel_index(torch.tensor(first), shape)] if shape else []
    if index:
        index[0] += row0
    shown = f"FP8 code 0x{int(value.view(torch.uint8)):02X}" if dtype == torch.float8_e4m3fn else str(value.item())
    raise NonFiniteError(f"{name} ({where}): {count:,} non-finite value{'s' * (count != 1)} (NaN/Inf), the first "
                         f"{shown} in block {block_of(index)} at index {index}; glmconv refuses NaN/Inf weights")
