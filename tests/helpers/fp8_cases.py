"""Weights for the FP8 encoding tests (CPU and tests/gpu): random blocks at every scale, and the edge values."""

from __future__ import annotations

import torch

from glmconv.numerics.fp8 import FP8_BLOCK as B


def random_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """BF16 values whose magnitude spans 2^-130..2^100 block by block (subnormal blocks included), signed."""
    g = torch.Generator().manual_seed(seed)
    sr, sc = -(-rows // B), -(-cols // B)
    exps = torch.randint(-130, 100, (sr, sc), generator=g).float()
    per = torch.exp2(exps).repeat_interleave(B, 0)[:rows].repeat_interleave(B, 1)[:, :cols]
    return (torch.randn(rows, cols, generator=g) * per).bfloat16()


def edge_weight() -> torch.Tensor:
    """Blocks of zeros, of subnormals, at BF16's largest value, negative only, one lone value, mixed."""
    w = torch.zeros(5 * B, 3 * B, dtype=torch.bfloat16)
    tiny = torch.finfo(torch.bfloat16).smallest_normal
    w[:B, B:2 * B] = tiny / 8  # subnormal
    w[:B, 2 * B:] = torch.arange(B * B).reshape(B, B).bfloat16() * tiny / 4096  # subnormals and zero
    w[B:2 * B, :B] = torch.finfo(torch.bfloat16).max
    w[B:2 * B, B:2 * B] = -torch.finfo(torch.bfloat16).max / 3
    w[2 * B:3 * B, :] = -torch.rand(B, 3 * B).bfloat16() - 1
    w[3 * B, 5] = 1e-30
    w[4 * B:, :] = torch.randn(B, 3 * B).bfloat16() * torch.tensor([1e-38, 1.0, 1e37]).repeat_interleave(B)
    return w


CASES = [*(("random", random_weight(1000, 700, s)) for s in range(6)), ("edges", edge_weight()),
         ("narrow", random_weight(257, 5, 9)), ("f32", random_weight(384, 300, 7).float() * 1.37)]
