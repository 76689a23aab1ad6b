"""Byte layouts: which bytes of a transform's inputs make each output, so that a pure move of bytes is copied
file to file without reading a value (the rules describe layouts; io locates and copies the bytes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of input tensor `source` (an index into a transform's inputs)."""

    source: int
    offset: int
    length: int


class Span(Protocol):
    """Bytes [offset, offset + length) of something (a Piece's input tensor, an io Extent's file)."""

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


S = TypeVar("S", bound=Span)


def take(pieces: Iterable[S], begin: int, end: int) -> list[S]:
    """The part of a byte layout covering output bytes [begin, end), pieces clipped at both ends (any frozen
    dataclass with `offset` and `length`: Pieces, or the file Extents of io)."""
    out: list[S] = []
    pos = 0
    for p in pieces:
        lo, hi = max(begin, pos), min(end, pos + p.length)
        if lo < hi:  # S is a dataclass (Piece, Extent), which the Protocol cannot say: hence the ignore
            out.append(dataclasses.replace(p, offset=p.offset + lo - pos, length=hi - lo))  # type: ignore[type-var]
        pos += p.length
        if pos >= end:
            break
    return out
