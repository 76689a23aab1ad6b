"""Torch references of GLM-5.3-Flash's ops (CPU-runnable): mHC, KDA, DSA attention, kpool indexer, MoE."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalised in fp32, cast back to x.dtype, then scaled by the weight."""
    import torch

    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
