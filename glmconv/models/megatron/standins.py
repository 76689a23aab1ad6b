"""Stand-ins for the two CUDA-only packages megatron-core's DSA layer reaches for, so its modules build and run
on any device: Transformer Engine's modules (which linears and norms megatron-core's spec asks a TE backend for,
saving the same keys) and `fast_hadamard_transform` (the DSA indexer's q/k rotation)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """fast_hadamard_transform.hadamard_transform in torch: x @ H_n * scale over the last dim (n a power of two,
    H_n Sylvester's +-1 matrix; the package zero-pads other sizes to the next power of two and crops)."""
    import torch

    n = x.shape[-1]
    size = 1 << max(0, math.ceil(math.log2(max(n, 1))))
    work = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least, as the package computes
    y = torch.nn.functional.pad(work, (0, size - n)) if size != n else work
    shape = y.shape
    y = y.reshape(-1, size)
    h = 1
    while h < size:  # the butterflies: (a, b) -> (a + b, a - b) on blocks of width 2h
        y = y.view(-1, size // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(shape)[..., :n] * scale).to(x.dtype)


def install_hadamard() -> str:
    """Where megatron-core's DSA indexer finds no `fast_hadamard_transform` (not installed, or no CUDA): hand its
    `rotate_activation` the torch stand-in. -> "fast_hadamard_transform" or "torch stand-in"."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    if dsa.hadamard_transform is None or dsa.hadamard_transform is hadamard_transform:
        dsa.hadamard_transform = hadamard_transform
        return "torch stand-in"
    return "fast_hadamard_transform"


def sylvester(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (n a power of two): the formula the transform is tested against."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _te_module() -> type:
    """A module that saves as a Transformer Engine module does: its weights, replicated, and an `_extra_state`
    (`torch.empty(0, dtype=torch.uint8)` when no FP8 recipe is set, transformer_engine/pytorch/ops/op.py)."""
    import torch

    class TEModule(torch.nn.Module):
        def get_extra_state(self) -> torch.Tensor:
            return torch.empty(0, dtype=torch.uint8)

        def set_extra_state(self, state: Any) -> None:
            pass

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (),
                               metadata: dict[str, Any] | None = None) -> Any:
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                       sharded_offsets)

    return TEModule


def te_linear() -> type:
    """TELinear(parallel_mode="duplicated"): one whole weight on every rank, no communication; saves `weight` and
    an `_extra_state` like TE's (replicated: no tensor-parallel axis)."""
    import torch

    class Duplicated(_te_module()):  # type: ignore[misc]  # a class made at run time (torch is imported late)
        def __init__(self, input_size: int, output_size: int, *, config: Any, bias: bool = False,
                     **unused: Any) -> None:
            super().__init__()
            if bias:
                raise ValueError("the duplicated linear stand-in has no bias (GLM's DSA has none)")
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype),
                                             requires_grad=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return torch.nn.functional.linear(x, self.weight), None

    return Duplicated


def te_norm(local: Any) -> type:
    """TENorm as it saves: the local norm's weights plus an `_extra_state` (`torch.empty(0, dtype=torch.uint8)` when
    no FP8 recipe is set, transformer_engine/pytorch/ops/op.py `get_extra_state`)."""
    from megatron.core.transformer.spec_utils import build_module

    class TENormStandIn(_te_module()):  # type: ignore[misc]  # a class made at run time (torch is imported late)
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__()
            if "config" in kw and kw["config"].sequence_parallel:  # TENorm runs under sequence parallelism; the
                kw["config"] = copy.copy(kw["config"])  # torch norm refuses it for its weight gradients' sake only
                kw["config"].sequence_parallel = False  # (torch_norm.py WrappedTorchNorm.__new__): no gradient here
            norm = build_module(local, *args, **kw)
            if "config" in kw:  # TE makes its norms' weights in params_dtype (_get_extra_te_kwargs); torch's norm
                norm.to(dtype=kw["config"].params_dtype)  # makes them fp32, which CUDA's bf16 kernels refuse
            for name, p in list(norm.named_parameters(recurse=False)):  # its weights as this module's own
                self.register_parameter(name, p)
            self._run: Any = norm.forward  # unregistered (no second copy of the keys): runs on the same parameters

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self._run(x)
            return out

    return TENormStandIn


@contextmanager
def cuda_device_query(device: torch.device) -> Iterator[None]:
    """While megatron-core builds or runs a module off CUDA: `torch.cuda.current_device()` answers "cpu".

    RotaryEmbedding asks it unconditionally (models/common/embeddings/rotary_pos_embedding.py: `__init__` without
    use_cpu_initialization, which the DSA modules do not pass, and `forward`, which moves `inv_freq` "to GPU");
    GLM's DSA is NoPE (qk_rope_head_dim 0), so the rotary tables are empty either way. On CUDA: nothing changes."""
    import torch

    if device.type == "cuda":
        yield
        return
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]  # the stand-in answer
    try:
        yield
    finally:
        torch.cuda.current_device = real
