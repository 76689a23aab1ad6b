"""Which prepared weights a model holds: every sub-block once loaded (resident), or one layer at a time (stream).

Streaming is what lets a full-size parity run fit one GPU: loading layer L's first sub-block drops every other
layer's weights, so a side holds about one MoE layer plus the hc streams whatever the depth. Both policies
hand the model the very same prepared tensors, so a streamed run equals a resident one bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from glmconv.models.weights import ExpertBank, Swiglu

Key = tuple[str, int]  # (sub-block kind, layer); layer -1 for model-wide pieces


class WeightCache:
    """Prepared weights by (kind, layer), with the time spent loading them (disk, dequantisation, transfer)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.load_s = 0.0
        self._held: dict[Key, Any] = {}

    def get(self, key: Key, load: Callable[[], Any]) -> Any:
        """The weights under `key`, loaded on first use; streaming first drops every other layer's."""
        if key in self._held:
            return self._held[key]
        if self.stream and key[1] >= 0:
            for other in [k for k in self._held if k[1] >= 0 and k[1] != key[1]]:
                del self._held[other]
        start = time.monotonic()
        value = self._held[key] = load()
        self.load_s += time.monotonic() - start
        return value

    def layers_held(self) -> list[int]:
        """The decoder layers with weights held now, ascending."""
        return sorted({k[1] for k in self._held if k[1] >= 0})


class LoadedBank(ExpertBank):
    """A layer's routed experts read once and stacked on the device, in their stored dtype.

    One read per expert per layer instead of one per use, and no host-to-device copy per expert in the forward.
    """

    def __init__(self, bank: ExpertBank, device: torch.device) -> None:
        self.num = bank.num
        first = bank.get(0)
        self._w = {name: torch.empty((self.num, *getattr(first, name).shape), dtype=getattr(first, name).dtype,
                                     device=device) for name in ("gate", "up", "down")}
        for e in range(self.num):
            s = first if e == 0 else bank.get(e)
            for name, stack in self._w.items():
                stack[e].copy_(getattr(s, name))

    def get(self, expert: int) -> Swiglu:
        return Swiglu(self._w["gate"][expert], self._w["up"][expert], self._w["down"][expert])
