"""Lazy HF tensor source: one memory-mapped tensor at a time, FP8 blocks dequantised on the way out."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.errors import CheckpointError
from glmconv.rules import names

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


class HfTensorSource:
    """Reads named tensors from safetensors shards on demand; keeps each shard open once (mmap)."""

    def __init__(self, files: dict[str, Path], *, check_finite: bool = False) -> None:
        self._files = files
        self._check_finite = check_finite
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> HfTensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def raw(self, name: str) -> torch.Tensor:
        """The tensor exactly as stored."""
        from safetensors import safe_open

        path = self._files.get(name)
        if path is None:
            raise CheckpointError(f"{name}: not in the checkpoint")
        handle = self._open.get(path)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"{path.name}: cannot open ({exc})") from None
            self._open[path] = handle
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{name} in {path.name}: cannot read ({exc})") from None

    def weight(self, name: str, out_dtype: torch.dtype) -> torch.Tensor:
        """The tensor in `out_dtype`; FP8 weights are dequantised with their `_scale_inv` blocks."""
        import torch

        from glmconv.io.fp8 import dequantize_fp8_blocks

        t = self.raw(name)
        if t.dtype == torch.float8_e4m3fn:
            scale = names.scale_name(name)
            if scale not in self._files:
                raise CheckpointError(f"{name}: FP8 weight without its {scale}")
            t = dequantize_fp8_blocks(t, self.raw(scale), out_dtype=out_dtype)
        elif t.dtype != out_dtype:
            t = t.to(out_dtype)
        if self._check_finite:
            require_finite(t, name, self._files[name].name)
        return t
