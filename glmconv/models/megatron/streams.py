"""glmconv's streams [T, hidden] (packed sequences by cu_seqlens) as megatron-core's modules take them: [S, B, H]
with S = T and B = 1, the packing in a PackedSeqParams (qkv_format "thd"); under tensor parallelism with
sequence parallelism (what AbsorbedMLASelfAttention requires at TP > 1) each rank holds its T / TP rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from glmconv.errors import GlmconvError

if TYPE_CHECKING:
    import torch


def packed(cu_seqlens: torch.Tensor, device: torch.device) -> Any:
    """megatron-core's PackedSeqParams of glmconv's cu_seqlens (int32, on the module's device)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def to_module(x: torch.Tensor) -> torch.Tensor:
    """[T, H] -> this rank's [T / TP, 1, H] (the whole [T, 1, H] at TP 1)."""
    tp, rank = _tp()
    if x.shape[0] % tp:
        raise GlmconvError(f"{x.shape[0]} tokens: tensor parallelism {tp} with sequence parallelism needs a multiple "
                           f"of {tp}")
    rows = x.shape[0] // tp
    return x[rank * rows:(rank + 1) * rows].unsqueeze(1).contiguous()


def from_module(y: torch.Tensor) -> torch.Tensor:
    """This rank's [T / TP, 1, H] -> the whole [T, H] (gathered over the tensor-parallel group)."""
    return gather_rows(y.squeeze(1))


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Each TP rank's rows of `t` (dim 0) -> all rows, on every rank (as is at TP 1)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp, _ = _tp()
    if tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts)


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank())
