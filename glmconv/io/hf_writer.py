"""Streaming sharded safetensors writer: memory bounded by one shard, HF file names and index at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from glmconv.errors import CheckpointError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
_PENDING = "shard-{:05d}.safetensors.partial"
_FINAL = "model-{:05d}-of-{:05d}.safetensors"


class ShardWriter:
    """Buffers tensors up to `max_shard_bytes`, flushes each shard to disk, names them all on `close()`.

    Shard count is unknown until the end, so shards are written under pending names and renamed to
    `model-0000i-of-0000N.safetensors` by `close()`, which also writes `model.safetensors.index.json`.
    A tensor larger than `max_shard_bytes` gets a shard of its own.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int) -> None:
        if max_shard_bytes < 1:
            raise CheckpointError(f"max shard size must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shard_of: dict[str, int] = {}
        self._shards = 0
        self.total_size = 0
        self._closed = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes the current shard first if this one would overflow it."""
        if self._closed:
            raise CheckpointError("ShardWriter is closed")
        if name in self._shard_of or name in self._buffer:
            raise CheckpointError(f"{name}: written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.detach().contiguous()
        self._buffer_bytes += nbytes
        self.total_size += nbytes

    def close(self) -> dict[str, str]:
        """Flush, rename shards to their final names, write the index; returns the weight map."""
        if self._closed:
            raise CheckpointError("ShardWriter is closed")
        if self._buffer:
            self._flush()
        if not self._shards:
            raise CheckpointError("no tensors were written")
        self._closed = True
        final = {i: _FINAL.format(i, self._shards) for i in range(1, self._shards + 1)}
        for i, name in final.items():
            os.replace(self.out_dir / _PENDING.format(i), self.out_dir / name)
        weight_map = {n: final[i] for n, i in sorted(self._shard_of.items())}
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        """Drop the buffer and delete the pending shards this writer made."""
        self._closed = True
        self._buffer.clear()
        for i in range(1, self._shards + 1):
            (self.out_dir / _PENDING.format(i)).unlink(missing_ok=True)

    @property
    def shards(self) -> int:
        return self._shards

    def _flush(self) -> None:
        from safetensors.torch import save_file

        self._shards += 1
        path = self.out_dir / _PENDING.format(self._shards)
        try:
            save_file(self._buffer, str(path), metadata={"format": "pt"})
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError (ENOSPC, EIO, ...)
            why = str(exc).strip().splitlines()
            raise CheckpointError(f"{path}: write failed ({why[0] if why else type(exc).__name__})") from None
        for name in self._buffer:
            self._shard_of[name] = self._shards
        self._buffer = {}
        self._buffer_bytes = 0
