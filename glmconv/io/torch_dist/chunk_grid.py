"""Byte ranges of a global tensor (C order) as byte ranges of the chunks that tile it, along any dims.

A trainer's saver splits tensors along dim 0 (column-parallel, experts), dim 1 (row-parallel) or both; the
chunks then form a grid: per dim a list of cut points, each chunk exactly one cell. In C order the global
tensor is a sequence of runs, each a contiguous piece of one chunk's own C-order bytes: a dim-0 chunk is one
run, a chunk split along dim k gives one run per index of the dims before k. `runs` walks that sequence
lazily, so a caller holds the runs of the range it asked for, never a copy of the data.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class Run:
    """Bytes [local, local + length) of chunk `chunk` (an index into the chunks given to `grid`)."""

    chunk: int
    local: int
    length: int


@dataclass(frozen=True)
class Grid:
    """The chunks of one tensor as cells of a grid: `cuts[d]` are dim d's cell starts followed by its size."""

    size: tuple[int, ...]
    itemsize: int
    boxes: tuple[Box, ...]
    cuts: tuple[tuple[int, ...], ...]
    cells: dict[tuple[int, ...], int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.itemsize

    def runs(self, begin: int, end: int) -> Iterator[Run]:
        """The runs covering global bytes [begin, end), in order, clipped at both ends."""
        pos = begin
        while pos < end:
            elem, skew = divmod(pos, self.itemsize)
            idx = _unravel(elem, self.size)
            chunk = self.cells[tuple(bisect.bisect_right(c, i) - 1 for c, i in zip(self.cuts, idx))]
            off, sz = self.boxes[chunk]
            local = tuple(i - o for i, o in zip(idx, off))
            length = min(_run_elems(self.size, off, sz, idx) * self.itemsize - skew, end - pos)
            yield Run(chunk, _ravel(local, sz) * self.itemsize + skew, length)
            pos += length


def grid(size: tuple[int, ...], boxes: list[Box], itemsize: int) -> Grid | None:
    """The grid the chunks form, or None: chunks that overlap, leave a gap or do not line up along some dim."""
    if not size:
        return Grid(size, itemsize, tuple(boxes), (), {(): 0}) if boxes == [((), ())] else None
    if any(len(o) != len(size) or len(s) != len(size) for o, s in boxes) or 0 in size:
        return None
    cuts = tuple(tuple(sorted({o[d] for o, _ in boxes})) + (size[d],) for d in range(len(size)))
    cells: dict[tuple[int, ...], int] = {}
    for n, (off, sz) in enumerate(boxes):
        cell = []
        for d, c in enumerate(cuts):
            i = bisect.bisect_left(c, off[d])
            if i + 1 >= len(c) or c[i] != off[d] or c[i + 1] != off[d] + sz[d] or sz[d] <= 0:
                return None
            cell.append(i)
        if tuple(cell) in cells:
            return None
        cells[tuple(cell)] = n
    if any(c[0] != 0 for c in cuts) or len(cells) != math.prod(len(c) - 1 for c in cuts):
        return None
    return Grid(size, itemsize, tuple(boxes), cuts, cells)


def boxes_of(chunks: list[Any]) -> list[Box]:
    """(offsets, sizes) of DCP ChunkStorageMetadata entries, as ints."""
    return [(tuple(int(o) for o in c.offsets), tuple(int(z) for z in c.sizes)) for c in chunks]


def _run_elems(size: tuple[int, ...], off: tuple[int, ...], sz: tuple[int, ...], idx: tuple[int, ...]) -> int:
    """Elements from global `idx` to the end of its run: through the chunk's last split dim k to the chunk's end
    along k, with the (whole) dims after k."""
    if not size:
        return 1  # a scalar
    split = [d for d in range(len(size)) if sz[d] != size[d]]
    k = split[-1] if split else 0
    inner = math.prod(size[k + 1:])
    return (off[k] + sz[k] - idx[k]) * inner - _ravel(idx[k + 1:], size[k + 1:])


def _unravel(flat: int, size: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for s in reversed(size):
        flat, i = divmod(flat, s)
        idx.append(i)
    return tuple(reversed(idx))


def _ravel(idx: tuple[int, ...], size: tuple[int, ...]) -> int:
    flat = 0
    for i, s in zip(idx, size):
        flat = flat * s + i
    return flat
