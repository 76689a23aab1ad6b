"""CPU buffers that reads land in, kept and handed out again once nothing holds them.

A new tensor's pages are faulted in and zeroed by the kernel as a read first writes them, and a large one is mapped
and unmapped around each use: on the 3 GB bench, reading every Megatron tensor into a new tensor ran at 2.2 GB/s a
thread against 5.5 GB/s into one reused buffer (benchmarks/RESULTS.md, 2026-12-06). A buffer is free again when
its storage has no holder left but this pool: every view, array or memoryview of it holds the storage, so a buffer
is never handed out while anything can still read or write it. Pinned reads (for a GPU) are left to torch's caching
host allocator, which keeps its blocks: on the H100 a new pinned tensor a read ran at 7.8-8.1 GB/s against 8.0-8.1
GB/s into a pool of pinned buffers like these, which held 0.5-0.7 GB more at its peak (RESULTS.md, 2026-12-06,
twelfth session; the pool was dropped).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIN_POOLED = 1 << 20  # smaller reads come from the heap: the allocator already reuses their pages
STEP = 1 << 20  # a buffer's size, rounded up to this


class ReadBuffers:
    """One reader thread's buffers, at most `most_bytes` of them (past that, a read gets a new tensor)."""

    def __init__(self, most_bytes: int) -> None:
        self._most = most_bytes
        self._slabs: list[tuple[torch.Tensor, torch.UntypedStorage, int]] = []  # (buffer, its storage, idle count)
        self._bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype`, in a free buffer of this pool where one fits."""
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        slab = self._free(nbytes) if nbytes >= MIN_POOLED else None
        if slab is None and nbytes >= MIN_POOLED:
            slab = self._new(nbytes)
        if slab is None:
            return torch.empty(shape, dtype=dtype)
        return slab[:nbytes].view(dtype).view(shape)

    @property
    def pooled_bytes(self) -> int:
        return self._bytes

    def _free(self, nbytes: int) -> torch.Tensor | None:
        """The smallest free buffer of at least `nbytes`."""
        fits = [(size, i) for size, i in self._idle() if size >= nbytes]
        return self._slabs[min(fits)[1]][0] if fits else None

    def _idle(self) -> list[tuple[int, int]]:
        """(size, index) of each buffer nothing but this pool holds."""
        import torch

        return [(s.numel(), i) for i, (s, storage, idle) in enumerate(self._slabs)
                if torch._C._storage_Use_Count(storage._cdata) == idle]

    def _new(self, nbytes: int) -> torch.Tensor | None:
        """A new buffer of `nbytes` (rounded up), free buffers dropped to make room; None past `most_bytes`."""
        import torch

        size = -(-nbytes // STEP) * STEP
        while self._bytes + size > self._most and self._drop_one_free():
            pass
        if self._bytes + size > self._most:
            return None
        slab = torch.empty(size, dtype=torch.uint8)
        storage = slab.untyped_storage()
        self._slabs.append((slab, storage, torch._C._storage_Use_Count(storage._cdata)))
        self._bytes += size
        return slab

    def _drop_one_free(self) -> bool:
        """The largest free buffer given back; False when none is free."""
        free = self._idle()
        if not free:
            return False
        size, i = max(free)
        del self._slabs[i]
        self._bytes -= size
        return True
