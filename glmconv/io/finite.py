"""--check-finite: the one check both readers run on every tensor they return."""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmconv.errors import CheckpointError

if TYPE_CHECKING:
    import torch


def require_finite(t: torch.Tensor, name: str, where: str, row0: int = 0) -> None:
    """--check-finite: a NaN or Inf is a CheckpointError naming the tensor and its first bad index."""
    import torch

    if not (t.is_floating_point() or t.is_complex()):
        return
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), t.shape)] if t.dim() else []
    value = t.reshape(-1)[flat].item()
    if index:
        index[0] += row0
    n = int(bad.sum())
    raise CheckpointError(f"{name} ({where}): non-finite value {value} at index {index} ({n} non-finite "
                          f"value{'s' * (n != 1)} in the tensor); --check-finite refuses NaN/Inf weights")
