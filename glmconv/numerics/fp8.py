"""FP8 e4m3 with 128x128 block scales, the way the GLM-5.3-Flash release stores its FP8 weights.

A weight W [r, c] is stored as `fp8` [r, c] (float8_e4m3fn) plus `scale_inv` [ceil(r/128), ceil(c/128)] (F32);
block (i, j) covers rows i*128.. and columns j*128.., cropped at the edges, and W ~= fp8 * scale_inv there.

Precision of `dequantize_fp8_blocks`: the fp8 -> fp32 conversion is exact, and the product with the F32 scale is
one IEEE fp32 multiply (correctly rounded, relative error <= 2^-24, the same bits on every device that multiplies
in fp32). It is not exact in general (4 significant bits x 24 give up to 28), but the cast to bf16 (2^-8) is the
only rounding that matters, and HF/sglang/DeepSeek `weight_dequant` do exactly this fp32 multiply then cast.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from glmconv.config import BLOCK_SIZE_KEY, weight_block_size
from glmconv.errors import CheckpointError, ConfigError
from glmconv.numerics.finite import require_finite
from glmconv.text import show

if TYPE_CHECKING:
    import torch

E4M3_MAX = 448.0
FP8_BLOCK = 128  # rows and columns of one scale block


class Fp8FormatError(CheckpointError):
    """An FP8 weight or its block scales have the wrong dtype or shape."""


def scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, int]:
    """ceil(rows/block) x ceil(cols/block): the `_scale_inv` shape of a 2-D weight (plain arithmetic, no torch)."""
    _check_block(block)
    if len(shape) != 2:
        raise Fp8FormatError(f"FP8 block scaling needs a 2-D weight, got shape {list(shape)}")
    rows, cols = shape
    return (-(-rows // block), -(-cols // block))


def quantize_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 weight, F32 scale_inv) with scale_inv = block amax / 448 (1 for all-zero blocks), on `w`'s device:
    fp32 reductions, IEEE divisions and the round-to-nearest-even cast only, so every device gives the same bytes."""
    import torch

    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise Fp8FormatError(f"quantize_fp8_blocks needs a float weight, got {w.dtype}")

    require_finite(w, "weight", "FP8 quantisation")  # a NaN or Inf would wipe its whole block
    rows, cols = w.shape if w.dim() == 2 else (0, 0)
    sr, sc = scale_shape(tuple(w.shape), block)
    if rows % block == 0 and cols % block == 0:  # the release's shapes: block views of w itself, no padded copy
        padded = w.float()
    else:
        padded = torch.zeros(sr * block, sc * block, dtype=torch.float32, device=w.device)
        padded[:rows, :cols] = w.float()
    blocks = padded.view(sr, block, sc, block)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())  # = abs().amax(), no |w| copy
    # by a tensor, never a Python number: CUDA divides by a number as a multiply by its fp32 reciprocal (one bit
    # off half the time); tensor / tensor is IEEE division, the same bits on every device (tests/gpu)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    scaled = (blocks / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = scaled.view(sr * block, sc * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize_fp8_blocks(fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK,
                          out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8.float() * scale_inv broadcast over each block (cropped at the edges), then cast to `out_dtype` (BF16),
    into `out` where given (the same cast: `copy_` rounds as `to` does)."""
    import torch

    if out_dtype is None:
        out_dtype = torch.bfloat16
    if fp8.dtype != torch.float8_e4m3fn:
        raise Fp8FormatError(f"expected a float8_e4m3fn weight, got {fp8.dtype}")
    if scale_inv.dtype != torch.float32:
        raise Fp8FormatError(f"expected F32 block scales, got {scale_inv.dtype}")
    want = scale_shape(tuple(fp8.shape), block)
    if tuple(scale_inv.shape) != want:
        raise Fp8FormatError(f"block scales of a {list(fp8.shape)} FP8 weight must be {list(want)}, "
                             f"got {list(scale_inv.shape)}")
    refuse_nan_codes(fp8)
    rows, cols = fp8.shape
    w = fp8.float()
    if rows % block == 0 and cols % block == 0:  # the release's shapes: multiply block views in place
        w.view(want[0], block, want[1], block).mul_(scale_inv[:, None, :, None])
    else:
        w.mul_(scale_inv.repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols])
    return w.to(out_dtype) if out is None else out.copy_(w)


def refuse_nan_codes(fp8: torch.Tensor) -> None:
    """NaN codes (0x7F/0xFF) are refused, not dequantised: a NaN would pass into the weight (callers that know the
    tensor's name check first, `glmconv.io.finite`)."""

    require_finite(fp8, "FP8 weight", "dequantisation")


def check_scales(scale_inv: torch.Tensor, name: str) -> None:
    """Refuse a zero, negative, subnormal or non-finite block scale: it would zero or sign-flip a block silently.

    The release's scales are block amax / 448 of real weights: positive normal float32 values.
    """
    import torch

    ok = torch.isfinite(scale_inv) & (scale_inv >= torch.finfo(torch.float32).tiny)
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()
    block = [int(i) for i in bad[0]]
    value = float(scale_inv[tuple(block)])
    more = f" ({len(bad)} such blocks)" if len(bad) > 1 else ""
    raise Fp8FormatError(f"{name}: block {block} has scale {value:.7g}; expected a positive, finite, normal float32 "
                         f"(block amax / 448){more}")


def check_block_size(config: dict[str, Any], scales: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> None:
    """The config's `quantization_config.weight_block_size` must describe `scales`, else a ConfigError naming a scale.

    `scales`: (name, shape, its weight's shape) of every FP8 weight's `_scale_inv`. glmconv reads and writes
    FP8_BLOCK x FP8_BLOCK blocks; a loader reads the config's block size. Where the two disagree about a scale's
    shape (ceil(rows/block) x ceil(cols/block)), the loader would spread each scale over the wrong block of the
    weight. A config of quant_method fp8 that declares no block size is refused too when there are FP8 weights: a
    loader may take their block scales for per-tensor ones (vLLM's Fp8Config does) or guess 128x128 (transformers'
    FineGrainedFP8Config does). Scales whose
    shape fits neither block size are left to the plan's scale-shape check.
    """
    declared = weight_block_size(config)
    expected = [FP8_BLOCK, FP8_BLOCK]
    fp8 = sorted((name, tuple(shape), tuple(weight)) for name, shape, weight in scales if len(weight) == 2)
    if declared is None:
        q = config.get("quantization_config")
        if fp8 and isinstance(q, dict) and q.get("quant_method") == "fp8":
            name, shape, weight = fp8[0]
            raise ConfigError(f"{BLOCK_SIZE_KEY}: expected {expected}, found absent; {show(name)} holds {list(shape)} "
                              f"block scales of a {list(weight)} FP8 weight ({FP8_BLOCK}x{FP8_BLOCK} blocks)")
        return
    for name, shape, weight in fp8:
        ours = scale_shape(weight)
        theirs = (-(-weight[0] // declared[0]), -(-weight[1] // declared[1]))
        if shape == ours != theirs:
            raise ConfigError(f"{BLOCK_SIZE_KEY}: expected {expected}, found {list(declared)}; {show(name)} holds "
                              f"{list(shape)} block scales of a {list(weight)} FP8 weight ({FP8_BLOCK}x{FP8_BLOCK} "
                              f"blocks; {list(declared)} blocks would need {list(theirs)})")


def _check_block(block: int) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise Fp8FormatError(f"block size must be a positive integer, got {block!r}")
