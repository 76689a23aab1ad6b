"""Byte routes: an output tensor as spans of stored Megatron tensors, located in the `.distcp` files, so a pure move of
bytes is copied file to file without reading a value (its bytes are scanned for NaN/Inf as they pass)."""

from __future__ import annotations

from collections.abc import Sequence

from glmconv.errors import CheckpointError
from glmconv.io import finite
from glmconv.io.byte_copy import Extent
from glmconv.io.dtypes import torch_dtype
from glmconv.io.safetensors.writer import PlannedTensor
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.rules.pieces import Piece

Span = tuple[str, int, int]  # bytes [begin, end) of a Megatron tensor (global, C order)


def locate(layout: list[list[Piece]], sources: Sequence[str], sizes: Sequence[int],
           reader: DcpReader) -> list[list[Span]] | None:
    """Output i's bytes (`layout[i]`, pieces of the tensors named `sources`) as spans the reader can locate in its
    files, when every byte can be and output i has `sizes[i]` bytes; None otherwise (the bytes must be computed).

    Spans, not extents: a tensor split along dim 1 has one extent per row piece, so extents are made one output
    at a time (`route_extents`)."""
    if len(layout) != len(sizes):
        return None
    for size, pieces in zip(sizes, layout):
        if not all(_locatable(p, sources, reader) for p in pieces) or sum(p.length for p in pieces) != size:
            return None
    return [piece_spans(pieces, sources) for pieces in layout]


def _locatable(p: Piece, sources: Sequence[str], reader: DcpReader) -> bool:
    if not 0 <= p.source < len(sources):
        return False
    name = sources[p.source]
    g = reader.grid(name) if reader.locatable(name) else None
    return g is not None and p.offset + p.length <= g.nbytes


def piece_spans(pieces: list[Piece], sources: Sequence[str]) -> list[Span]:
    """Pieces of the tensors named `sources` as spans (relayout: its layouts are checked where they are composed)."""
    return [(sources[p.source], p.offset, p.offset + p.length) for p in pieces]


def scanned_extents(reader: DcpReader, spans: list[Span], t: PlannedTensor) -> list[Extent]:
    """`route_extents`, the bytes scanned for NaN/Inf as they are copied (the HF tensor's own index and block)."""

    extents = route_extents(reader, spans)
    finite.require_finite_extents(extents, torch_dtype(t.dtype), tuple(t.shape), t.name, str(reader.iter_dir))
    return extents


def route_extents(reader: DcpReader, spans: list[Span]) -> list[Extent]:
    """The file extents of one HF tensor's spans, in order (every chunk was located by `locate`)."""
    extents: list[Extent] = []
    for name, begin, end in spans:
        found = reader.byte_extents(name, begin, end)
        if found is None:
            raise CheckpointError(f"{name}: bytes {begin}..{end} could not be located after all")
        extents.extend(found)
    return extents

