"""Byte routes: an output tensor as spans of stored Megatron tensors, located in the `.distcp` files, so a pure move of
bytes is copied file to file without reading a value (its bytes are scanned for NaN/Inf as they pass)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmconv.errors import CheckpointError
from glmconv.io.byte_copy import Extent
from glmconv.io.dtypes import torch_dtype
from glmconv.io.finite import require_finite_extents
from glmconv.io.safetensors.writer import PlannedTensor
from glmconv.io.torch_dist.reader import DcpReader

if TYPE_CHECKING:

    pass

Span = tuple[str, int, int]  # bytes [begin, end) of a Megatron tensor (global, C order)

def scanned_extents(reader: DcpReader, spans: list[Span], t: PlannedTensor) -> list[Extent]:
    """`route_extents`, the bytes scanned for NaN/Inf as they are copied (the HF tensor's own index and block)."""

    extents = route_extents(reader, spans)
    require_finite_extents(extents, torch_dtype(t.dtype), tuple(t.shape), t.name, str(reader.iter_dir))
    return extents

def route_extents(reader: DcpReader, spans: list[Span]) -> list[Extent]:
    """The file extents of one HF tensor's spans, in order (every chunk was located by `byte_route`)."""
    extents: list[Extent] = []
    for name, begin, end in spans:
        found = reader.byte_extents(name, begin, end)
        if found is None:
            raise CheckpointError(f"{name}: bytes {begin}..{end} could not be located after all")
        extents.extend(found)
    return extents


