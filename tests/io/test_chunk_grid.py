"""Byte ranges of a global tensor as runs of the chunks that tile it: dim 0, dim 1, both, or refused."""

from __future__ import annotations

import torch

from glmconv.io.torch_dist.chunk_grid import Box, grid


def _chunks(full: torch.Tensor, boxes: list[Box]) -> list[bytes]:
    """Each chunk's own C-order bytes, as a saver stores them."""
    out = []
    for off, sz in boxes:
        t = full
        for d, (o, s) in enumerate(zip(off, sz)):
            t = t.narrow(d, o, s)
        out.append(t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


def _follow(full: torch.Tensor, boxes: list[Box], begin: int, end: int) -> bytes:
    g = grid(tuple(full.shape), boxes, full.element_size())
    assert g is not None
    stored = _chunks(full, boxes)
    return b"".join(stored[r.chunk][r.local:r.local + r.length] for r in g.runs(begin, end))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_chunks_split_along_dims_0_and_1_give_the_global_bytes_for_any_range() -> None:
    full = torch.arange(4 * 6 * 5, dtype=torch.float32).view(4, 6, 5).to(torch.bfloat16)
    boxes = [((r, c, 0), (2, 2, 5)) for c in (4, 0, 2) for r in (2, 0)]  # a 2 x 3 grid, listed out of order
    raw = _bytes(full)
    for begin, end in ((0, len(raw)), (3, 77), (20, 21), (100, len(raw) - 1), (9, 9)):
        assert _follow(full, boxes, begin, end) == raw[begin:end], (begin, end)


def test_a_dim1_split_is_one_run_per_row_and_chunk_and_a_dim0_split_one_run_per_chunk() -> None:
    full = torch.randn(3, 8)
    cols = grid((3, 8), [((0, 0), (3, 4)), ((0, 4), (3, 4))], 4)
    rows = grid((3, 8), [((0, 0), (1, 8)), ((1, 0), (2, 8))], 4)
    assert cols is not None and rows is not None
    assert [(r.chunk, r.local, r.length) for r in cols.runs(0, 96)] == [
        (0, 0, 16), (1, 0, 16), (0, 16, 16), (1, 16, 16), (0, 32, 16), (1, 32, 16)]
    assert [(r.chunk, r.local, r.length) for r in rows.runs(0, 96)] == [(0, 0, 32), (1, 0, 64)]
    assert _follow(full, [((0, 0), (3, 4)), ((0, 4), (3, 4))], 0, 96) == _bytes(full)


def test_chunks_that_overlap_leave_a_gap_or_do_not_line_up_form_no_grid() -> None:
    assert grid((4, 4), [((0, 0), (4, 2)), ((0, 1), (4, 3))], 2) is None  # overlap
    assert grid((4, 4), [((0, 0), (4, 2))], 2) is None  # gap
    assert grid((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], 2) is None  # not one grid
    assert grid((4, 4), [((0, 0), (4, 4)), ((0, 0), (4, 4))], 2) is None  # the same chunk twice
    assert grid((), [((), ())], 2) is not None
