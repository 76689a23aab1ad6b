"""Reversible tensor transforms between the HF and Megatron layouts, one class per transform.

Each transform maps the HF tensors of one rule (in rule order) to its Megatron tensors (`forward`) and
back (`backward`), and infers the Megatron shapes from the HF shapes without touching data.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from glmconv.rules.pieces import Piece

if TYPE_CHECKING:  # torch is imported lazily: planning and auditing names never need it
    import torch

Shape = tuple[int, ...]
Layout = list[list[Piece]]


def _nbytes(shape: Shape, itemsize: int) -> int:
    return math.prod(shape) * itemsize


class Transform(ABC):
    """One reversible HF <-> Megatron operation. It moves values and makes none (no arithmetic): export checks a
    weight for NaN/Inf once, where it is read (`runners.backward`'s `finite`)."""

    # `backward` undoes `forward` exactly and the reverse (bytes only move): checking one direction proves the
    # other (verify). A transform that pads, drops or duplicates values must leave it False.
    exact_inverse: ClassVar[bool] = False

    @abstractmethod
    def mcore_shapes(self, hf_shapes: list[Shape], n_mcore: int) -> list[Shape]:
        """Megatron shapes for these HF shapes."""

    @abstractmethod
    def forward(self, hf: list[torch.Tensor], n_mcore: int) -> list[torch.Tensor]:
        """HF tensors -> Megatron tensors."""

    @abstractmethod
    def backward(self, mcore: list[torch.Tensor], hf_shapes: list[Shape]) -> list[torch.Tensor]:
        """Megatron tensors -> HF tensors of `hf_shapes`."""

    def forward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        """Each Megatron tensor's bytes as pieces of the HF tensors' bytes; None where bytes are not just moved."""
        return None

    def backward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        """Each HF tensor's bytes as pieces of the Megatron tensors' bytes; None where bytes are not just moved."""
        return None

    def hf_for_rows(self, rows: range, n_hf: int) -> list[int] | None:
        """The HF tensors (indices, in the order `forward` takes them) behind rows `rows` of the one Megatron
        tensor, so a large tensor can be moved a few rows at a time; None when it does not split that way."""
        return None


@dataclass(frozen=True)
class Rename(Transform):
    """1:1, same bytes under another name."""

    exact_inverse: ClassVar[bool] = True

    def mcore_shapes(self, hf_shapes: list[Shape], n_mcore: int) -> list[Shape]:
        return list(hf_shapes)

    def forward(self, hf: list[torch.Tensor], n_mcore: int) -> list[torch.Tensor]:
        return list(hf)

    def backward(self, mcore: list[torch.Tensor], hf_shapes: list[Shape]) -> list[torch.Tensor]:
        return list(mcore)

    def forward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        return [[Piece(i, 0, _nbytes(s, itemsize))] for i, s in enumerate(hf_shapes)]

    def backward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        return self.forward_layout(hf_shapes, itemsize, n_mcore)


@dataclass(frozen=True)
class Concat(Transform):
    """n HF tensors concatenated along `dim` into one (gate ++ up, q ++ k ++ v conv)."""

    exact_inverse: ClassVar[bool] = True

    dim: int = 0

    def mcore_shapes(self, hf_shapes: list[Shape], n_mcore: int) -> list[Shape]:
        out = list(hf_shapes[0])
        out[self.dim] = sum(s[self.dim] for s in hf_shapes)
        return [tuple(out)]

    def forward(self, hf: list[torch.Tensor], n_mcore: int) -> list[torch.Tensor]:
        import torch

        return [torch.cat(hf, dim=self.dim)]

    def backward(self, mcore: list[torch.Tensor], hf_shapes: list[Shape]) -> list[torch.Tensor]:
        import torch

        return list(torch.split(mcore[0], [s[self.dim] for s in hf_shapes], dim=self.dim))

    def forward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        if any(math.prod(s[:self.dim]) != 1 for s in hf_shapes):
            return None  # interleaved rows: not a byte concatenation
        return [[Piece(i, 0, _nbytes(s, itemsize)) for i, s in enumerate(hf_shapes)]]

    def backward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        if any(math.prod(s[:self.dim]) != 1 for s in hf_shapes):
            return None
        sizes = [_nbytes(s, itemsize) for s in hf_shapes]
        return [[Piece(0, sum(sizes[:i]), n)] for i, n in enumerate(sizes)]


@dataclass(frozen=True)
class SplitVector(Transform):
    """One HF vector [n] split into n Megatron tensors [1] (hc scale -> alpha_pre/post/res)."""

    exact_inverse: ClassVar[bool] = True

    def mcore_shapes(self, hf_shapes: list[Shape], n_mcore: int) -> list[Shape]:
        (shape,) = hf_shapes
        if shape != (n_mcore,):
            raise ValueError(f"SplitVector expects a [{n_mcore}] vector, got {list(shape)}")
        return [(1,)] * n_mcore

    def forward(self, hf: list[torch.Tensor], n_mcore: int) -> list[torch.Tensor]:
        return [hf[0][i:i + 1].clone() for i in range(hf[0].shape[0])]

    def backward(self, mcore: list[torch.Tensor], hf_shapes: list[Shape]) -> list[torch.Tensor]:
        import torch

        return [torch.cat(mcore)]

    def forward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        return [[Piece(0, i * itemsize, itemsize)] for i in range(n_mcore)]

    def backward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        return [[Piece(i, 0, itemsize) for i in range(n_mcore)]]


@dataclass(frozen=True)
class StackExperts(Transform):
    """Per-expert HF weights stacked on a new leading expert axis; gated fc1 is all gates, then all ups.

    HF order is template-major: `[gate_0 .. gate_{E-1}, up_0 .. up_{E-1}]` (or `[down_0 ..]`).
    """

    exact_inverse: ClassVar[bool] = True

    parts: int = 1

    def mcore_shapes(self, hf_shapes: list[Shape], n_mcore: int) -> list[Shape]:
        experts = len(hf_shapes) // self.parts
        rows, cols = hf_shapes[0]
        return [(experts, rows * self.parts, cols)]

    def forward(self, hf: list[torch.Tensor], n_mcore: int) -> list[torch.Tensor]:
        import torch

        experts = len(hf) // self.parts
        chunks = [torch.stack(hf[p * experts:(p + 1) * experts]) for p in range(self.parts)]
        return [torch.cat(chunks, dim=1) if self.parts > 1 else chunks[0]]

    def backward(self, mcore: list[torch.Tensor], hf_shapes: list[Shape]) -> list[torch.Tensor]:
        stacked = mcore[0]
        parts = stacked.chunk(self.parts, dim=1)
        return [expert for part in parts for expert in part.unbind(0)]

    def forward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        experts, n = len(hf_shapes) // self.parts, _nbytes(hf_shapes[0], itemsize)
        return [[Piece(p * experts + e, 0, n) for e in range(experts) for p in range(self.parts)]]

    def backward_layout(self, hf_shapes: list[Shape], itemsize: int, n_mcore: int) -> Layout | None:
        experts, n = len(hf_shapes) // self.parts, _nbytes(hf_shapes[0], itemsize)
        return [[Piece(0, (e * self.parts + p) * n, n)] for p in range(self.parts) for e in range(experts)]

    def hf_for_rows(self, rows: range, n_hf: int) -> list[int] | None:
        experts = n_hf // self.parts
        return [p * experts + e for p in range(self.parts) for e in rows]
