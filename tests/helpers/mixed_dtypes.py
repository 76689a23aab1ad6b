"""Where a CPU run would fail on CUDA: a norm or linear handed floating tensors of different dtypes (a bf16 input
with fp32 weights). CPU kernels promote such a mix; CUDA's dispatch on the input's dtype and refuse the weight
("expected scalar type BFloat16 but found Float": the megatron backend's first real-cut4 run on an H100,
2026-12-06, with megatron-core's torch norms left in fp32)."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

WATCHED = ("layer_norm", "rms_norm", "group_norm", "linear")


class MixedDtypes(TorchFunctionMode):
    """Records each watched call whose floating tensor arguments are not all of one dtype, as `name: dtypes`."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in WATCHED:
            dtypes = sorted({str(t.dtype) for t in (*args, *kwargs.values())
                             if isinstance(t, torch.Tensor) and t.is_floating_point()})
            if len(dtypes) > 1:
                self.found.append(f"{name}: {', '.join(dtypes)}")
        return func(*args, **kwargs)
