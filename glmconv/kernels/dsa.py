"""DSA attention on a GPU through megatron-core's tilelang SparseMLA; reference: `glmconv.ops.dsa.sparse_mla`.

The kernel is DeepSeek-V3.2's absorbed MLA: q [B, S, H, 576], kv [B, S, 1, 576], int32 indices (-1 = none)
in tiles of 64, bf16. GLM-5.3's DSA is NoPE, so the absorbed query q_h W_uk,h and the latent (R <= 512) are
zero-padded to 576 (a zero tail adds nothing to any score), sm_scale is passed as Dn^-0.5 (1/16 at the real
dims; the kernel's default would be 576^-0.5), index rows are padded with -1 to a multiple of 64 (2051 ->
2112), heads are padded to a power of two >= 16. Compiled kernels are cached per shape by megatron-core
(the first call of a shape compiles for ~15 s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


KV_DIM = 576  # the kernel's q/kv width (512 latent + 64 rope tail in DeepSeek's layout)
V_DIM = 512  # the kernel's output width
BLOCK_I = 64  # index tile
SEQ_BUCKET = 256  # megatron-core's interface pads the sequence to a multiple of this (MCORE_DSA_TILELANG_SEQ_BUCKET)


def index_width(width: int) -> int:
    """The top-k width the kernel takes: `width` rounded up to the index tile."""
    return -(-width // BLOCK_I) * BLOCK_I


def padded_heads(heads: int) -> int:
    """Heads the kernel runs: a power of two >= 16 up to 64, else a multiple of 64."""
    if heads <= 64:
        return max(16, 1 << (heads - 1).bit_length())
    return -(-heads // 64) * 64


def kernel_indices(topk: torch.Tensor) -> torch.Tensor:
    """[T, W] ids (any int dtype) -> contiguous int32 [T, index_width(W)], -1 padded (no copy if already so)."""
    import torch
    import torch.nn.functional as F

    width = index_width(topk.shape[1])
    if topk.dtype == torch.int32 and topk.shape[1] == width and topk.is_contiguous():
        return topk
    return F.pad(topk.int(), (0, width - topk.shape[1]), value=-1).contiguous()


def attend_latent(q_abs: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """The bare kernel call: q_abs [T, Hp, 576], kv [T, 576] bf16, indices [T, W64] int32 -> [T, Hp, 512]."""
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_sparse_mla_fwd import (
        sparse_mla_fwd_interface,
    )

    out: torch.Tensor  # megatron-core's tilelang op has no types
    out, _ = sparse_mla_fwd_interface(q_abs, kv.unsqueeze(1), indices.unsqueeze(1), sm_scale=scale, d_v=V_DIM)
    return out


def sparse_mla(q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor, topk: torch.Tensor, v_dim: int,
               scale: float) -> torch.Tensor:
    """Same contract as the reference: -> [T, H, Dv] in q.dtype; `topk` [T, W] ids into `latent`, -1 = none.

    The absorption writes straight into the kernel's padded [T', Hp, 576] buffer (a bmm whose output is a
    strided view, its weight zero-padded to 576 columns) and the un-absorption reads the kernel's output in
    place, so no padded copy of q or of the output is made; T' is T rounded up to megatron-core's sequence
    bucket (256), so its interface pads nothing either.
    """
    import torch
    import torch.nn.functional as F

    t, heads, nope = q.shape
    rank = latent.shape[1]
    if rank > V_DIM:
        raise ValueError(f"SparseMLA takes a latent of at most {V_DIM}, not {rank}")
    w = kv_b.to(torch.bfloat16).view(heads, nope + v_dim, rank)
    w_uk = F.pad(w[:, :nope], (0, KV_DIM - rank))  # [H, Dn, 576], zero columns past the latent
    hp, rows = padded_heads(heads), -(-t // SEQ_BUCKET) * SEQ_BUCKET
    q_abs = torch.empty(rows, hp, KV_DIM, dtype=torch.bfloat16, device=q.device)
    if rows > t:
        q_abs[t:].zero_()
    if hp > heads:
        q_abs[:t, heads:].zero_()
    torch.bmm(q.to(torch.bfloat16).transpose(0, 1), w_uk, out=q_abs[:t, :heads].transpose(0, 1))
    kv = F.pad(latent.to(torch.bfloat16), (0, KV_DIM - rank, 0, rows - t))
    ids = kernel_indices(topk)
    if rows > t:
        ids = F.pad(ids, (0, 0, 0, rows - t), value=-1)
    o_lat = attend_latent(q_abs, kv, ids, scale)  # [T', Hp, 512]
    out = torch.empty(t, heads, v_dim, dtype=torch.bfloat16, device=q.device)
    torch.bmm(o_lat[:t, :heads, :rank].transpose(0, 1), w[:, nope:].transpose(1, 2), out=out.transpose(0, 1))
    return out.to(q.dtype)
