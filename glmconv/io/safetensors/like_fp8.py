"""`export --fp8 --like`'s source of FP8 codes and scales: the --like checkpoint, one weight at a time
(`glmconv.numerics.fp8_reuse` decides which of its blocks are kept)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmconv.io.closing import Closing
from glmconv.io.safetensors.checkpoint import HfCheckpoint
from glmconv.io.safetensors.reader import HfTensorSource
from glmconv.rules import names
from glmconv.rules.table import F32, FP8

if TYPE_CHECKING:
    import torch


class LikeFp8(Closing):
    """The --like checkpoint's FP8 codes and scales, read one weight at a time (bounded memory)."""

    def __init__(self, ck: HfCheckpoint) -> None:
        """`ck`: --like as `inspect_hf_checkpoint` read it (its headers are not parsed again)."""
        self._stored = {n: t.dtype for n, t in ck.tensors.items()}
        self._source: HfTensorSource = HfTensorSource(ck.tensor_files(), headers=ck.headers, reuse_buffers=True)

    def close(self) -> None:
        self._source.close()

    def pair(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(codes, scales) of FP8 weight `name` in --like, or None where --like does not store it as FP8."""
        return self.pairs([name])[0]

    def pairs(self, weights: list[str], pin: bool = False) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Each weight's `pair`; the codes read into one buffer and the scales into another (`pin`: pinned), in
        order, so that a step's experts stack without a copy."""
        stored = [w for w in weights if self._stored.get(w) == FP8 and self._stored.get(names.scale_name(w)) == F32]
        codes = self._source.raw_many(stored, pin)
        scales = self._source.raw_many([names.scale_name(w) for w in stored], pin)
        found = dict(zip(stored, zip(codes, scales)))
        return [found.get(w) for w in weights]
