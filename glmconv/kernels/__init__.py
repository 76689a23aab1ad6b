"""GPU kernels of GLM-5.3-Flash's attention ops, each beside a pointer to its torch reference in glmconv.ops.

  kda.py   fla's chunk_kda + causal_conv1d        reference glmconv.ops.kda.kda_layer
  dsa.py   megatron-core's tilelang SparseMLA     reference glmconv.ops.dsa.sparse_mla
  kpool.py glmconv's triton kpool indexer         reference glmconv.ops.kpool.kpool_topk

`op_set(kernels, device)` picks one or the other for a model: `auto` = the kernels on CUDA, the references
elsewhere; `reference` = the references everywhere. The imports of fla / tilelang / triton happen only
when a kernel op set is built, so the CPU path never needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from glmconv.defaults import AUTO, KERNEL_CHOICES
from glmconv.errors import GlmconvError
from glmconv.kernels import dsa, kda
from glmconv.ops.dsa import sparse_mla
from glmconv.ops.kda import kda_layer
from glmconv.ops.kpool import kpool_topk

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OpSet:
    """The attention ops a model calls (same signatures as the references)."""

    name: str
    kda_layer: Callable[..., torch.Tensor]
    indexer: Callable[..., torch.Tensor]
    sparse_mla: Callable[..., torch.Tensor]


def reference_ops() -> OpSet:
    return OpSet("reference", kda_layer, kpool_topk, sparse_mla)


def kernel_ops(index_width: int) -> OpSet:
    """fla KDA, tilelang SparseMLA, triton kpool (its ids come out int32 and -1 padded as the kernel takes them)."""
    import torch

    try:  # the packages the kernels call, imported now so a missing one is a one-line error, not a mid-run crash
        import fla.modules.causal_conv1d
        import fla.ops.kda  # noqa: F401
        import megatron.core.transformer.experimental_attention_variant.ops.tilelang_sparse_mla_fwd  # noqa: F401

        from glmconv.kernels import kpool  # a triton module: it compiles its kernels when imported
    except ImportError as exc:
        raise GlmconvError(f"--kernels auto on CUDA needs fla-core, tilelang and megatron-core ({exc}); "
                           "use --kernels reference") from None
    indexer: Any = partial(kpool.kpool_topk, width=dsa.index_width(index_width), dtype=torch.int32)
    return OpSet("kernels", kda.kda_layer, indexer, dsa.sparse_mla)


def op_set(kernels: str, device: torch.device, index_width: int) -> OpSet:
    """The ops for `--kernels kernels` on `device`."""
    if kernels not in KERNEL_CHOICES:
        raise GlmconvError(f"--kernels {kernels!r}: choose from {', '.join(KERNEL_CHOICES)}")
    if kernels == AUTO and device.type == "cuda":
        return kernel_ops(index_width)
    return reference_ops()
