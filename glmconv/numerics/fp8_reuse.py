"""`export --fp8 --like`: keep the --like checkpoint's own FP8 codes and scales wherever they still reproduce the
weight, block by block, so an untouched FP8 checkpoint round-trips byte-identical (docs/fp8.md).

A 128x128 block is reused whole (codes and scale) when its --like codes times its --like scale, dequantised
exactly as convert does (`dequantize_fp8_blocks` into the weight's dtype), equal the exported weight bit for
bit and the scale is one convert accepts; every other block is re-quantised whole (`quantize_fp8_exact_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmconv.numerics.fp8 import E4M3_MAX, FP8_BLOCK, dequantize_fp8_blocks, scale_shape
from glmconv.numerics.fp8_exact import block_any, quantize_fp8_exact_blocks

if TYPE_CHECKING:
    import torch

_INT_VIEW_BYTES = (2, 4)  # bf16/f16 and f32 weights are compared as int16/int32 bit patterns


@dataclass
class Fp8Blocks:
    """One FP8 weight as written: codes, scales, and per-block counts of what happened to it."""

    codes: torch.Tensor
    scales: torch.Tensor
    requantized: int  # blocks quantised anew (the rest are --like's bytes)
    scale_adjusted: int  # of those, blocks whose scale moved off amax/448
    inexact: int  # of those, blocks that still do not reproduce the weight


def encode(w: torch.Tensor, like: tuple[torch.Tensor, torch.Tensor] | None) -> Fp8Blocks:
    """`w` as FP8: --like's blocks where they reproduce `w` bit for bit, the others re-quantised."""
    return split_stacked(*encode_stacked(w, like, 1))[0]


def encode_stacked(w: torch.Tensor, like: tuple[torch.Tensor, torch.Tensor] | None,
                   n: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """`n` weights of one shape, each whole 128-row blocks, stacked by rows (and --like's pairs stacked alike),
    encoded in one call: `encode` is block-local, so each weight's rows of the codes and scales are the bytes
    `encode` gives it alone, and its counts (requantized, scale_adjusted, inexact) are its own blocks'. Returns the
    stack's codes and scales (--like's own tensors when every block is reused) and each weight's counts: one
    transfer and one synchronisation on a GPU for many small weights."""
    import torch

    keep = reusable_blocks(w, *like) if like is not None else None
    if like is not None and keep is not None and bool(keep.all()):
        return like[0], like[1], [(0, 0, 0)] * n
    q, s, moved, inexact = quantize_fp8_exact_blocks(w)
    if like is None or keep is None:
        codes, scales, new = q, s, torch.ones_like(moved)
    else:
        new = keep.logical_not()
        codes = torch.where(_elements(new, tuple(w.shape)), q.view(torch.uint8),
                            like[0].view(torch.uint8)).view(torch.float8_e4m3fn)
        scales = torch.where(new, s, like[1]).contiguous()
    per_weight = torch.stack([new, moved & new, inexact & new]).reshape(3, n, -1).sum(dim=2).tolist()
    return codes, scales, list(zip(*per_weight))


def split_stacked(codes: torch.Tensor, scales: torch.Tensor, counts: list[tuple[int, int, int]]) -> list[Fp8Blocks]:
    """`encode_stacked`'s result as each weight's own `Fp8Blocks` (views of the stack's rows)."""
    n = len(counts)
    if n == 1:
        return [Fp8Blocks(codes, scales, *counts[0])]
    rows, block_rows = codes.shape[0] // n, scales.shape[0] // n
    return [Fp8Blocks(codes[i * rows:(i + 1) * rows], scales[i * block_rows:(i + 1) * block_rows], *c)
            for i, c in enumerate(counts)]


def reusable_blocks(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """Per block: do --like's codes and scale give back `w` exactly (and is the scale valid)? None: not comparable.

    A valid scale times the largest code is finite in `w`'s dtype and codes are never NaN (dequantisation refuses
    them), so a reused block proves its values of `w` finite: export needs no other NaN/Inf check of them."""
    import torch

    if not comparable(w, codes, scales):
        return None
    bits = torch.int16 if w.element_size() == 2 else torch.int32
    got = dequantize_fp8_blocks(codes, scales, out_dtype=w.dtype)
    same = block_any(got.view(bits) != w.contiguous().view(bits)).logical_not()
    valid = torch.isfinite((scales * E4M3_MAX).to(w.dtype)) & (scales >= torch.finfo(torch.float32).tiny)
    return same & valid


def comparable(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether --like's codes and scales can stand for `w` block by block: FP8 codes of its shape, F32 scales of its
    block grid, `w` a 2-D weight compared by its bits."""
    import torch

    return (w.dim() == 2 and w.element_size() in _INT_VIEW_BYTES and codes.dtype == torch.float8_e4m3fn
            and tuple(codes.shape) == tuple(w.shape) and scales.dtype == torch.float32
            and tuple(scales.shape) == scale_shape(tuple(w.shape)))


def _elements(blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A per-block mask spread over the elements of a `shape` weight."""

    rows, cols = shape
    return blocks.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
