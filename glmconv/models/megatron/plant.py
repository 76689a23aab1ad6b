"""A weight defect of the self-test planted in what megatron-core's modules run.

glmconv plants a defect into its own prepared weights (glmconv.compare.defects: a copy of the sub-block's
structure with one field damaged). A megatron-core module runs the parameters it loaded from the checkpoint, so for
the call each parameter (or buffer) that holds a tensor the defect changed holds the damaged tensor instead. The
parameter is found by value, never by name: it equals the clean tensor, or a SwiGLU's gate and up stacked (the
fc1 of an expert or of the shared expert). A changed tensor no parameter holds is refused: a defect must not be
silently left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from glmconv.errors import GlmconvError
from glmconv.models.weights import ExpertBank, Swiglu

if TYPE_CHECKING:
    import torch

Change = tuple["torch.Tensor", "torch.Tensor"]  # (clean, damaged)


def changes(clean: Any, damaged: Any) -> list[Change]:
    """The tensors the defect changed, walking both structures together (a SwiGLU's gate and up as one fc1)."""
    import torch

    if clean is damaged or clean is None:
        return []
    if isinstance(clean, torch.Tensor):
        return [] if _same(clean, damaged) else [(clean, damaged)]
    if isinstance(clean, Swiglu):
        out: list[Change] = []
        if not (_same(clean.gate, damaged.gate) and _same(clean.up, damaged.up)):
            out.append((torch.cat([clean.gate, clean.up]), torch.cat([damaged.gate, damaged.up])))
        return out + changes(clean.down, damaged.down)
    if isinstance(clean, ExpertBank):
        return [c for e in range(clean.num) for c in changes(clean.get(e), damaged.get(e))]
    if dataclasses.is_dataclass(clean):
        return [c for f in dataclasses.fields(clean) for c in changes(getattr(clean, f.name), getattr(damaged, f.name))]
    return []


@contextmanager
def planted(module: Any, found: list[Change], where: str) -> Iterator[None]:
    """Run `module` with each changed tensor's parameter holding the damaged tensor; restored on exit."""
    import torch

    held = [*module.parameters(), *module.buffers()]
    swaps: list[tuple[torch.Tensor, torch.Tensor]] = []
    for clean, damaged in found:
        hits = [p for p in held if p.shape == clean.shape and torch.equal(p, clean.to(p.device, p.dtype))]
        if not hits:
            raise GlmconvError(f"{where}: the planted defect changes a {list(clean.shape)} tensor that no parameter "
                               "of megatron-core's module holds here")
        swaps += [(p, p.data) for p in hits]
        for p in hits:
            p.data = damaged.to(p.device, p.dtype)
    try:
        yield
    finally:
        for p, data in reversed(swaps):
            p.data = data


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor: the same object, or a view of the same memory (a loaded bank hands out views)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype)
