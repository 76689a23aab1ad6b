"""GPU kernels of GLM-5.3-Flash's attention ops, each beside a pointer to its torch reference in glmconv.ops.

  kda.py   fla's causal_conv1d (short_conv) + chunk_kda (kda_core)   references glmconv.ops.kda
  dsa.py   megatron-core's tilelang SparseMLA (sparse_mla)           reference  glmconv.ops.dsa.sparse_mla
  kpool.py glmconv's triton kpool indexer (indexer)                  reference  glmconv.ops.kpool.kpool_topk
  check.py each kernel against its reference on the same input;  bounds.py what a correct kernel stays within

`op_set(kernels, device)` picks the ops a model runs: `auto` = the kernels on CUDA, the references elsewhere;
`reference` = the references everywhere; `emulated` = the kernel path with the references standing in for the
kernels (everything parity does with kernels, checks included, on a machine without a GPU). The imports of
fla / tilelang / triton happen only when a kernel op set is built, so the CPU path never needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from glmconv.defaults import AUTO, EMULATED, KERNEL_CHOICES, REFERENCE
from glmconv.errors import GlmconvError
from glmconv.kernels import dsa, kda
from glmconv.ops import dsa as dsa_ref
from glmconv.ops import kda as kda_ref
from glmconv.ops import kpool as kpool_ref
from glmconv.quiet import quiet

if TYPE_CHECKING:
    import torch


KERNEL_NAMES = {"short_conv": "fla causal_conv1d", "kda_core": "fla chunk_kda", "indexer": "triton kpool indexer",
                "sparse_mla": "tilelang SparseMLA"}


@dataclass(frozen=True)
class OpSet:
    """The ops a model calls, each with its reference's signature; `kernel_names` says what each op runs."""

    OPS: ClassVar[tuple[str, ...]] = ("short_conv", "kda_core", "indexer", "sparse_mla")

    name: str  # reference, kernels or emulated
    short_conv: Callable[..., torch.Tensor]
    kda_core: Callable[..., torch.Tensor]
    indexer: Callable[..., torch.Tensor]
    sparse_mla: Callable[..., torch.Tensor]
    kernel_names: dict[str, str] = field(default_factory=dict)

    @property
    def is_reference(self) -> bool:
        return self.name == REFERENCE

    def kernel_name(self, op: str) -> str:
        return self.kernel_names.get(op, op)

    def with_op(self, op: str, fn: Callable[..., Any]) -> OpSet:
        """This op set with `op` run by `fn` (a planted kernel-path defect)."""
        changes: dict[str, Any] = {op: fn}
        return replace(self, **changes)


def reference_ops() -> OpSet:
    return OpSet(REFERENCE, kda_ref.short_conv, kda_ref.kda_core, kpool_ref.kpool_topk, dsa_ref.sparse_mla)


def emulated_ops() -> OpSet:
    """The kernel path with each kernel emulated by its reference (named after the kernel it stands in for)."""
    return replace(reference_ops(), name=EMULATED,
                   kernel_names={op: f"reference for {kernel}" for op, kernel in KERNEL_NAMES.items()})


def kernel_ops(index_width: int) -> OpSet:
    """fla KDA, tilelang SparseMLA, triton kpool (its ids come out int32 and -1 padded as the kernel takes them)."""
    import torch

    try:  # the packages the kernels call, imported now: a missing one is a one-line error, not a mid-run crash
        with quiet():
            import fla.modules.causal_conv1d
            import fla.ops.kda  # noqa: F401
            import megatron.core.transformer.experimental_attention_variant.ops.tilelang_sparse_mla_fwd  # noqa: F401

            from glmconv.kernels import kpool  # a triton module: it compiles its kernels when imported
    except ImportError as exc:
        raise GlmconvError(f"--kernels auto on CUDA needs fla-core, tilelang and megatron-core ({exc}); "
                           "use --kernels reference") from None
    indexer: Any = partial(kpool.kpool_topk, width=dsa.index_width(index_width), dtype=torch.int32)
    return OpSet("kernels", kda.short_conv, kda.kda_core, indexer, dsa.sparse_mla, kernel_names=dict(KERNEL_NAMES))


def op_set(kernels: str, device: torch.device, index_width: int) -> OpSet:
    """The ops for `--kernels kernels` on `device`."""
    if kernels not in KERNEL_CHOICES:
        raise GlmconvError(f"--kernels {kernels!r}: choose from {', '.join(KERNEL_CHOICES)}")
    if kernels == EMULATED:
        return emulated_ops()
    if kernels == AUTO and device.type == "cuda":
        return kernel_ops(index_width)
    return reference_ops()
