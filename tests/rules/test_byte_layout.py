"""Byte layouts of the transforms: moving the pieces reproduces forward()/backward() byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from glmconv.io.byte_copy import Extent, FileCopier, merge, read_into
from glmconv.rules.ops import Concat, Rename, SplitVector, StackExperts, Transform
from glmconv.rules.pieces import Piece, take


def _assemble(layout: list[Piece], inputs: list[torch.Tensor]) -> bytes:
    raw = [t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() for t in inputs]
    return b"".join(raw[p.source][p.offset:p.offset + p.length] for p in layout)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


CASES: list[tuple[Transform, list[tuple[int, ...]], int]] = [
    (Rename(), [(5, 3)], 1),
    (Concat(dim=0), [(4, 6), (2, 6), (3, 6)], 1),
    (SplitVector(), [(3,)], 3),
    (StackExperts(parts=2), [(3, 4)] * 10, 1),
    (StackExperts(parts=1), [(4, 3)] * 6, 1),
]


@pytest.mark.parametrize(("transform", "shapes", "n_mcore"), CASES, ids=lambda c: repr(c)[:30])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_layout_reproduces_forward_bytes(transform: Transform, shapes: list, n_mcore: int,
                                                 dtype: torch.dtype) -> None:
    hf = [torch.randn(s).to(dtype) for s in shapes]
    layout = transform.forward_layout(shapes, hf[0].element_size(), n_mcore)
    assert layout is not None
    expected = transform.forward(hf, n_mcore)
    assert [_assemble(pieces, hf) for pieces in layout] == [_bytes(t) for t in expected]


@pytest.mark.parametrize(("transform", "shapes", "n_mcore"), CASES, ids=lambda c: repr(c)[:30])
def test_backward_layout_reproduces_backward_bytes(transform: Transform, shapes: list, n_mcore: int) -> None:
    hf = [torch.randn(s).to(torch.bfloat16) for s in shapes]
    mcore = transform.forward(hf, n_mcore)
    layout = transform.backward_layout(shapes, 2, n_mcore)
    assert layout is not None
    assert [_assemble(pieces, mcore) for pieces in layout] == [_bytes(t) for t in hf]


def test_concat_on_an_inner_dim_has_no_byte_layout() -> None:
    assert Concat(dim=1).forward_layout([(4, 2), (4, 3)], 2, 1) is None
    assert Concat(dim=1).backward_layout([(4, 2), (4, 3)], 2, 1) is None


def test_concat_on_dim_one_of_a_single_row_is_a_byte_concatenation() -> None:
    assert Concat(dim=1).forward_layout([(1, 2), (1, 3)], 2, 1) == [[Piece(0, 0, 4), Piece(1, 0, 6)]]


def test_take_clips_pieces_to_the_byte_range() -> None:
    pieces = [Piece(0, 0, 10), Piece(1, 5, 10), Piece(2, 0, 10)]
    assert take(pieces, 5, 22) == [Piece(0, 5, 5), Piece(1, 5, 10), Piece(2, 0, 2)]
    assert take(pieces, 10, 20) == [Piece(1, 5, 10)]


def test_merge_fuses_adjacent_extents_of_one_file(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    got = merge([Extent(a, 0, 4), Extent(a, 4, 4), Extent(b, 8, 2), Extent(a, 8, 1), Extent(a, 20, 0)])
    assert got == [Extent(a, 0, 8), Extent(b, 8, 2), Extent(a, 8, 1)]


def _files(tmp_path: Path) -> tuple[Path, Path, bytes, bytes]:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    da, db = os.urandom(100_000), os.urandom(5_000)
    a.write_bytes(da)
    b.write_bytes(db)
    return a, b, da, db


def test_file_copier_appends_extents_in_order(tmp_path: Path) -> None:
    a, b, da, db = _files(tmp_path)
    out = tmp_path / "out"
    with open(out, "wb", buffering=0) as f, FileCopier() as copier:
        f.write(b"head")
        n = copier.copy([Extent(b, 10, 100), Extent(a, 1000, 50_000), Extent(b, 0, 3)], f.fileno())
        f.write(b"tail")
    assert n == 50_103
    assert out.read_bytes() == b"head" + db[10:110] + da[1000:51_000] + db[:3] + b"tail"


def test_file_copier_falls_back_to_pread_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, _, da, _ = _files(tmp_path)

    def refuse(*args: object) -> int:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    out = tmp_path / "out"
    with open(out, "wb", buffering=0) as f, FileCopier() as copier:
        copier.copy([Extent(a, 7, 90_000)], f.fileno())
    assert out.read_bytes() == da[7:90_007]


def test_copy_past_the_end_of_a_source_names_the_file(tmp_path: Path) -> None:
    from glmconv.errors import CheckpointError

    a, _, _, _ = _files(tmp_path)
    with open(tmp_path / "out", "wb", buffering=0) as f, FileCopier() as copier:
        with pytest.raises(CheckpointError, match="a.bin: ends before byte 100000"):
            copier.copy([Extent(a, 99_000, 2_000)], f.fileno())


def test_read_into_fills_a_buffer_from_extents(tmp_path: Path) -> None:
    a, b, da, db = _files(tmp_path)
    buf = bytearray(300)
    read_into([Extent(a, 50, 200), Extent(b, 0, 100)], memoryview(buf))
    assert bytes(buf) == da[50:250] + db[:100]
