"""Which prepared weights a model holds: every sub-block once loaded (resident), or one layer at a time (stream).

Streaming is what lets a full-size parity run fit one GPU: loading layer L's first sub-block drops every other
layer's weights, so a side holds about one MoE layer plus the hc streams whatever the depth. Both policies
hand the model the very same prepared tensors, so a streamed run equals a resident one bit for bit.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from glmconv.ahead import Step, run_ahead
from glmconv.models.weights import ExpertBank, Swiglu

if TYPE_CHECKING:
    import torch


Key = tuple[str, int]  # (sub-block kind, layer); layer -1 for model-wide pieces
LOAD_THREADS = min(8, os.cpu_count() or 1)
LOAD_AHEAD_BYTES = 2 << 30  # expert bytes read ahead of the device copy, at most (a group larger runs alone)


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
    Groups of experts are read on `LOAD_THREADS` threads (file reads, unpickling and dequantisation release the
    GIL): a full-size MoE layer is 21.7 GB across both checkpoints, and reading it is most of a parity run.
    """

    on_device = True

    def __init__(self, bank: ExpertBank, device: torch.device) -> None:
        self.num, self.nbytes = bank.num, bank.nbytes
        self._w: dict[str, torch.Tensor] = {}
        per_expert = bank.nbytes // max(1, bank.num)

        def read(group: range) -> list[tuple[range, list[Swiglu]]]:
            return [(group, bank.read(group))]

        steps = (Step(len(g) * per_expert, partial(read, g)) for g in bank.groups())
        for experts, swiglus in run_ahead(steps, LOAD_THREADS, LOAD_AHEAD_BYTES):
            for e, s in zip(experts, swiglus):
                for name in ("gate", "up", "down"):
                    self._put(name, e, getattr(s, name), device)

    def _put(self, name: str, expert: int, w: torch.Tensor, device: torch.device) -> None:
        import torch

        if name not in self._w:
            self._w[name] = torch.empty((self.num, *w.shape), dtype=w.dtype, device=device)
        self._w[name][expert].copy_(w)

    def get(self, expert: int) -> Swiglu:
        return Swiglu(self._w["gate"][expert], self._w["up"][expert], self._w["down"][expert])

