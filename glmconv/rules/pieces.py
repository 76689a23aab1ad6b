"""Byte layouts: which bytes of a transform's inputs make each output, so that a pure move of bytes is copied
file to file without reading a value (the rules describe layouts; io locates and copies the bytes)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of input tensor `source` (an index into a transform's inputs)."""

    source: int
    offset: int
    length: int


def take(pieces: Iterable[Piece], begin: int, end: int) -> list[Piece]:
    """The part of a byte layout covering output bytes [begin, end), pieces clipped at both ends."""
    out: list[Piece] = []
    pos = 0
    for p in pieces:
        lo, hi = max(begin, pos), min(end, pos + p.length)
        if lo < hi:
            out.append(Piece(p.source, p.offset + lo - pos, hi - lo))
        pos += p.length
        if pos >= end:
            break
    return out
