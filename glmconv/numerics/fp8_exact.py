"""FP8 re-quantisation that reproduces bf16 values exactly: e4m3 codes with block scales moved so that
`dequantize_fp8_blocks(q, s)` gives back the bf16 weight bit for bit (docs/fp8.md says why amax/448 does not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmconv.numerics.fp8 import FP8_BLOCK as B
from glmconv.numerics.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks, scale_shape

if TYPE_CHECKING:
    import torch

_SHRINK = 2.0**-20  # keeps a product q*s strictly inside its bf16 rounding interval despite fp32 rounding


def quantize_fp8_exact(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """`quantize_fp8_blocks`, then each block's scale moved to the nearest fp32 at which q * scale == w in bf16.

    Returns (codes, scales, blocks whose scale moved off amax/448, blocks that still do not reproduce w).
    """
    q, s, moved, inexact = quantize_fp8_exact_blocks(w)
    return q, s, int(moved.sum()), int(inexact.sum())


def quantize_fp8_exact_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_fp8_exact` with per-block masks (scale moved, not reproduced): callers that keep some blocks
    (export --like, glmconv/numerics/fp8_reuse.py) count only the blocks they take."""
    import torch

    w = w.contiguous()
    q, s = quantize_fp8_blocks(w)
    if w.dtype != torch.bfloat16:
        none = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
        return q, s, none, none.clone()
    lo, hi = _scale_bounds(q, w)
    moved = torch.where(lo <= hi, torch.minimum(torch.maximum(s, lo), hi), s)
    exact = block_any(dequantize_fp8_blocks(q, moved).view(torch.int16) != w.view(torch.int16)).logical_not()
    final = torch.where(exact, moved, s)
    return q, final.contiguous(), final != s, exact.logical_not()


def block_any(mask: torch.Tensor) -> torch.Tensor:
    """Per 128x128 block of a 2-D bool tensor: does any element hold (edge blocks cropped)."""
    return _blocks(mask, False)


def _scale_bounds(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the fp32 scales s with bf16(q * s) == w for every element (lo > hi: none)."""
    import torch

    a = w.abs()
    bits = a.view(torch.int16)
    af, qa = a.float(), q.float().abs_()
    zero = qa == 0
    # each step one IEEE fp32 operation, in place: by a tensor, or by a number fp32 holds exactly (0.5, 1 +- 2^-20);
    # the division is by a tensor (CUDA divides by a number as a multiply by its reciprocal: glmconv/numerics/fp8.py)
    lo = (bits - 1).clamp_min_(0).view(torch.bfloat16).float()  # the bf16 below |w|, then the midpoint's scale
    lo.add_(af).mul_(0.5).div_(qa).mul_(1 + _SHRINK).masked_fill_(zero, 0.0)
    hi = (bits + 1).view(torch.bfloat16).float()  # the bf16 above |w|
    hi.add_(af).mul_(0.5).div_(qa).mul_(1 - _SHRINK).masked_fill_(zero, float("inf"))
    return _blocks(lo, 0.0, "amax"), _blocks(hi, float("inf"), "amin")


def _blocks(x: torch.Tensor, fill: float | bool, how: str = "any") -> torch.Tensor:
    """Reduce a 2-D tensor over its 128x128 blocks (edge blocks padded with `fill`)."""
    import torch

    rows, cols = x.shape
    sr, sc = scale_shape((rows, cols), B)
    if rows % B == 0 and cols % B == 0 and x.is_contiguous():  # the release's shapes: block views, no padded copy
        view = x.view(sr, B, sc, B)
    else:
        padded = torch.full((sr * B, sc * B), fill, dtype=x.dtype, device=x.device)
        padded[:rows, :cols] = x
        view = padded.view(sr, B, sc, B)
    if how == "any":
        return view.any(dim=3).any(dim=1)
    return view.amax(dim=(1, 3)) if how == "amax" else view.amin(dim=(1, 3))
