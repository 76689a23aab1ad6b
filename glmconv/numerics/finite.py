"""NaN and Inf in weights: one check, in every dtype glmconv reads or writes (FP8 codes 0x7F/0xFF included),
naming the tensor, the 128x128 block of the first bad value, and how many there are."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from glmconv.errors import CheckpointError

if TYPE_CHECKING:
    import torch

BLOCK = 128  # the FP8 scale block: where a bad value is, in the grid the release's scales use
E4M3_NAN = 0x7F  # e4m3fn has no Inf; S.1111.111 is NaN
SCAN_ELEMENTS = 1 << 24  # a tensor is checked this many values at a time: the scratch stays small

# dtype name -> (magnitude bits, smallest non-finite magnitude): a value is NaN or Inf exactly when its bits,
# sign cleared, are at least that (the exponent all ones; e4m3fn: its NaN codes). The dtypes checked cheaply; the
# byte scan of copied files (glmconv/io/finite.py) reads these bits, tensors are checked by value.
NON_FINITE_BITS: dict[str, tuple[int, int]] = {
    "bfloat16": (0x7FFF, 0x7F80), "float16": (0x7FFF, 0x7C00), "float32": (0x7FFFFFFF, 0x7F800000),
    "float64": (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000), "float8_e4m3fn": (E4M3_NAN, E4M3_NAN)}


class NonFiniteError(CheckpointError):
    """A weight holds NaN or Inf: refused, never passed on (FP8 re-quantisation would wipe its block)."""


def non_finite(t: torch.Tensor) -> torch.Tensor:
    """Where `t` is NaN or Inf (FP8 e4m3fn: its NaN codes); all False for integer tensors."""
    import torch

    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) & E4M3_NAN) == E4M3_NAN
    if t.is_floating_point() or t.is_complex():
        return ~torch.isfinite(t)
    return torch.zeros(t.shape, dtype=torch.bool, device=t.device)


def any_non_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds a NaN or Inf, a window at a time with no full-size mask: a float's smallest and largest
    value (`aminmax` propagates NaN; one pass, 8x `torch.isfinite` on BF16), FP8's codes against the table."""
    import torch

    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return False
    if t.is_complex() or str(t.dtype).removeprefix("torch.") not in NON_FINITE_BITS:
        return bool(non_finite(t).any())
    flat = t.reshape(-1)
    windows = (flat[at:at + SCAN_ELEMENTS] for at in range(0, flat.numel(), SCAN_ELEMENTS))
    if t.dtype == torch.float8_e4m3fn:  # no arithmetic on FP8: its codes, sign cleared, against the NaN code
        return any(int((w.view(torch.uint8) & E4M3_NAN).max()) == E4M3_NAN for w in windows)
    return not all(math.isfinite(float(lo)) and math.isfinite(float(hi)) for lo, hi in map(torch.aminmax, windows))


def require_finite(t: torch.Tensor, name: str, where: str, row0: int = 0) -> None:
    """A NaN or Inf in `t` is a NonFiniteError naming the tensor, the block and the count (`row0`: the first
    row of `t` in its tensor, for a row range)."""
    import torch

    if not any_non_finite(t):
        return
    bad = non_finite(t)
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)] if t.dim() else []
    if index:
        index[0] += row0
    n = int(bad.sum())
    raise NonFiniteError(f"{name} ({where}): {n:,} non-finite value{'s' * (n != 1)} (NaN/Inf), the first "
                         f"{_value(t, flat)} in block {block_of(index)} at index {index}; glmconv refuses NaN/Inf "
                         f"weights")


def block_of(index: list[int]) -> list[int]:
    """The 128x128 block of an element: the last two dims by 128 (a 1-D tensor: by 128), leading dims as they are."""
    if len(index) <= 2:
        return [i // BLOCK for i in index]
    return index[:-2] + [i // BLOCK for i in index[-2:]]


def _value(t: torch.Tensor, flat: int) -> str:
    import torch

    if t.dtype == torch.float8_e4m3fn:
        return f"FP8 code 0x{int(t.reshape(-1)[flat].view(torch.uint8)):02X}"
    return str(t.reshape(-1)[flat].item())
