"""Lazy HF tensor source: one memory-mapped tensor at a time, FP8 blocks dequantised on the way out."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.errors import CheckpointError
from glmconv.rules import names

if TYPE_CHECKING:
    import torch


class HfTensorSource:
    """Reads named tensors from safetensors shards on demand; keeps each shard open once (mmap)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files
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
            return dequantize_fp8_blocks(t, self.raw(scale), out_dtype=out_dtype)
        return t if t.dtype == out_dtype else t.to(out_dtype)
