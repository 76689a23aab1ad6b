"""The kpool indexer on a GPU; reference: `glmconv.ops.kpool.kpool_topk` (same contract, same selections).

Four steps, no per-sequence python loop and no host sync (so it can sit in a CUDA graph):
  1. layout: per pool its first token, per query the [lo, hi) range of its visible pools (torch, on device);
  2. pooling: keys[p] = sum_j softmax_j(gate + ape) * ik_j per channel (triton, fp32);
  3. scoring: sum_h w_h relu(iq_h . key * d^-0.5) over (query tile, pool tile) with every head in one
     program, tiles past the causal frontier skipped, invisible pools -inf (triton; the dot is 3-pass tf32,
     about fp32 accurate, so only near-ties can pick differently from the fp32 reference);
  4. top-k of each row (torch.topk), then token expansion and tail append in one triton kernel.
Pools are numbered globally over the packed batch; each query's visible pools are one contiguous range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from glmconv.ops.kpool import K_NORM_EPS, IndexerTensors, KpoolParams

SCORE_PRECISION = "tf32x3"

# The kernels' pointer and scalar arguments are typed `tl.tensor` (what they are inside a kernel): triton reads a
# parameter's annotation (a dtype name such as `int` would pin its type and drop triton's specialisation on its
# value; `tl.tensor` is none), and its code generator resolves the annotation's names as globals of the kernel, which
# must be modules or constexprs (`Any` fails to compile in triton 3.6: tests/kernels/test_kpool_compiles.py).
# `triton.jit` is untyped for mypy: triton ships no py.typed.


@dataclass(frozen=True)
class Layout:
    """Where pools and queries sit in the packed batch (all device tensors, int32)."""

    pool_tok: torch.Tensor  # [Pmax] first token of pool p, -1 past the last complete pool
    lo: torch.Tensor  # [T] first pool of the query's sequence
    hi: torch.Tensor  # [T] one past its last visible pool
    krow: torch.Tensor  # [T] min(topk / kpool, pools of its sequence): where the reference puts the tail
    tail: torch.Tensor  # [T] tokens of its incomplete pool, (local position + 1) % kpool


def layout(cu_seqlens: torch.Tensor, tokens: int, kpool: int, pools_per_row: int) -> Layout:
    """The packed layout from cu_seqlens, computed on the device (no .item(), no .tolist())."""
    dev = cu_seqlens.device
    cu = cu_seqlens.long()
    n_pools = (cu[1:] - cu[:-1]) // kpool
    pool_cu = F.pad(n_pools.cumsum(0), (1, 0))
    p = torch.arange(tokens // kpool, device=dev)
    pseq = torch.searchsorted(pool_cu[1:], p, right=True).clamp(max=n_pools.shape[0] - 1)
    pool_tok = torch.where(p < pool_cu[-1], cu[pseq] + (p - pool_cu[pseq]) * kpool, -1)
    t = torch.arange(tokens, device=dev)
    tseq = torch.searchsorted(cu[1:], t, right=True).clamp(max=n_pools.shape[0] - 1)
    local = t - cu[tseq] + 1
    lo = pool_cu[tseq]
    return Layout(pool_tok.int(), lo.int(), (lo + local // kpool).int(),
                  n_pools[tseq].clamp(max=pools_per_row).int(), (local % kpool).int())


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no py.typed
def _pool_kernel(ik: tl.tensor, gate: tl.tensor, ape: tl.tensor, pool_tok: tl.tensor, keys: tl.tensor,
                 n_pools: tl.tensor, D: tl.constexpr,
                 KP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr) -> None:
    """keys[p, :] = per-channel softmax over the pool's KP tokens of (gate + ape), weighting ik."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    tok = tl.load(pool_tok + p, mask=p < n_pools, other=-1)
    ok = (tok >= 0)[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_P, BLOCK_D], float("-inf"), tl.float32)
    for j in tl.static_range(KP):
        a = tl.load(ape + j * D + d, mask=d < D, other=0.0).to(tl.float32)
        g = tl.load(gate + (tok + j)[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        m = tl.maximum(m, g + a[None, :])
    s = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
    for j in tl.static_range(KP):
        a = tl.load(ape + j * D + d, mask=d < D, other=0.0).to(tl.float32)
        g = tl.load(gate + (tok + j)[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        k = tl.load(ik + (tok + j)[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        e = tl.exp(g + a[None, :] - m)
        s += e
        acc += e * k
    out = tl.where(ok, acc / s, 0.0)
    tl.store(keys + p[:, None] * D + d[None, :], out, mask=(p < n_pools)[:, None] & (d < D)[None, :])


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no py.typed
def _score_kernel(iq: tl.tensor, keys: tl.tensor, head_w: tl.tensor, lo: tl.tensor, hi: tl.tensor, scores: tl.tensor,
                  T: tl.tensor, n_pools: tl.tensor,
                  scale: tl.tensor, H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_D: tl.constexpr, PRECISION: tl.constexpr) -> None:
    """scores[t, p] = sum_h w[t, h] relu(iq[t, h] . keys[p] * scale) for lo[t] <= p < hi[t], else -inf."""
    t = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < T
    row_lo = tl.load(lo + t, mask=t_ok, other=2147483647)
    row_hi = tl.load(hi + t, mask=t_ok, other=0)
    p0 = tl.program_id(1) * BLOCK_P
    acc = tl.zeros([BLOCK_Q, BLOCK_P], tl.float32)
    if (p0 < tl.max(row_hi)) & (p0 + BLOCK_P > tl.min(row_lo)):
        k = tl.load(keys + p[:, None] * D + d[None, :], mask=(p < n_pools)[:, None] & (d < D)[None, :], other=0.0)
        k_t = tl.trans(k)
        for h in range(H):
            q = tl.load(iq + (t[:, None] * H + h) * D + d[None, :], mask=t_ok[:, None] & (d < D)[None, :],
                        other=0.0).to(tl.float32)
            s = tl.dot(q, k_t, input_precision=PRECISION) * scale
            w = tl.load(head_w + t * H + h, mask=t_ok, other=0.0)
            acc += tl.maximum(s, 0.0) * w[:, None]
    visible = (p[None, :] >= row_lo[:, None]) & (p[None, :] < row_hi[:, None])
    out = tl.where(visible, acc, float("-inf"))
    tl.store(scores + t[:, None] * n_pools + p[None, :], out, mask=t_ok[:, None] & (p < n_pools)[None, :])


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no py.typed
def _expand_kernel(chosen: tl.tensor, pool_tok: tl.tensor, lo: tl.tensor, hi: tl.tensor, krow: tl.tensor,
                   tail: tl.tensor, out: tl.tensor, K: tl.tensor,
                   width: tl.tensor, KP: tl.constexpr, TAIL: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_C: tl.constexpr) -> None:
    """Row t: its visible chosen pools as token ids (best first), -1 up to krow * KP, then the tail."""
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    c = tl.arange(0, BLOCK_C)
    n_vis = tl.minimum(tl.load(hi + t) - tl.load(lo + t), K)
    pool = tl.load(chosen + t * K + j, mask=j < n_vis, other=0)
    first = tl.load(pool_tok + pool, mask=j < n_vis, other=-1)
    ids = first[:, None] + c[None, :]  # slots past n_vis keep the -1 they were filled with
    tl.store(out + t * width + j[:, None] * KP + c[None, :], ids.to(out.dtype.element_ty),
             mask=(j < n_vis)[:, None] & (c < KP)[None, :])
    if TAIL:
        count = tl.load(tail + t)
        at = tl.load(krow + t) * KP
        tail_ids = tl.where(c < count, t + 1 - count + c, -1)
        tl.store(out + t * width + at + c, tail_ids.to(out.dtype.element_ty), mask=c < KP - 1)


def pool_keys(ik: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, lay: Layout, kpool: int) -> torch.Tensor:
    """[Pmax, d] fp32 pool keys (zeros past the last complete pool)."""
    n, d = lay.pool_tok.shape[0], ik.shape[-1]
    keys = torch.empty(n, d, dtype=torch.float32, device=ik.device)
    if n:
        block_p = 16
        _pool_kernel[(triton.cdiv(n, block_p),)](ik.contiguous(), gate.contiguous(), ape.contiguous(),
                                                 lay.pool_tok, keys, n, D=d, KP=kpool, BLOCK_P=block_p,
                                                 BLOCK_D=triton.next_power_of_2(d))
    return keys


def pool_scores(iq: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, lay: Layout, block_q: int = 64,
                block_p: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """[T, Pmax] fp32 scores, -inf where the pool is not visible to the query."""
    t, h, d = iq.shape
    n = keys.shape[0]
    scores = torch.empty(t, n, dtype=torch.float32, device=iq.device)
    if t and n:
        grid = (triton.cdiv(t, block_q), triton.cdiv(n, block_p))
        _score_kernel[grid](iq.contiguous(), keys, head_w.float().contiguous(), lay.lo, lay.hi, scores, t, n,
                            d ** -0.5, H=h, D=d, BLOCK_Q=block_q, BLOCK_P=block_p,
                            BLOCK_D=max(16, triton.next_power_of_2(d)), PRECISION=SCORE_PRECISION,
                            num_warps=num_warps, num_stages=num_stages)
    return scores


def expand(chosen: torch.Tensor, lay: Layout, p: KpoolParams, width: int | None = None,
           dtype: torch.dtype = torch.long) -> torch.Tensor:
    """[T, width] token ids from the chosen pools [T, K] (best first) and the tail; -1 elsewhere."""
    t, k = chosen.shape
    width = p.width if width is None else width
    out = torch.full((t, width), -1, dtype=dtype, device=chosen.device)
    if t:
        _expand_kernel[(t,)](chosen.contiguous(), lay.pool_tok, lay.lo, lay.hi, lay.krow, lay.tail, out, k, width,
                             KP=p.kpool, TAIL=p.select_tail, BLOCK_K=max(1, triton.next_power_of_2(k)),
                             BLOCK_C=triton.next_power_of_2(p.kpool))
    return out


def select(iq: torch.Tensor, ik: torch.Tensor, gate: torch.Tensor, head_w: torch.Tensor, ape: torch.Tensor,
           p: KpoolParams, cu_seqlens: torch.Tensor, width: int | None = None,
           dtype: torch.dtype = torch.long) -> torch.Tensor:
    """The kernel part of the indexer: projections in, [T, width] packed token ids out."""
    t = iq.shape[0]
    pools_per_row = min(p.topk // p.kpool, t // p.kpool)
    lay = layout(cu_seqlens.to(iq.device), t, p.kpool, p.topk // p.kpool)
    keys = pool_keys(ik, gate, ape, lay, p.kpool)
    scores = pool_scores(iq, keys, head_w, lay)
    if pools_per_row:
        chosen = scores.topk(pools_per_row, dim=-1).indices.int()
    else:
        chosen = scores.new_empty(t, 0, dtype=torch.int32)
    return expand(chosen, lay, p, width, dtype)


def kpool_topk(x: torch.Tensor, q_resid: torch.Tensor, w: IndexerTensors, p: KpoolParams,
               cu_seqlens: torch.Tensor, width: int | None = None, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Same contract as the reference `kpool_topk`; `width` / `dtype` let the attention kernel take it as is.

    Without compress tensors (megatron-core's token-level indexer, kpool 1) each one-token pool's softmax over a
    zero gate and ape is exactly 1: its key is the token's own ik, as the reference computes it."""
    iq = F.linear(q_resid, w.wq_b).view(x.shape[0], p.heads, p.head_dim)
    ik = F.layer_norm(F.linear(x, w.wk), (p.head_dim,), w.k_norm_weight, w.k_norm_bias, K_NORM_EPS)
    if w.compress_gate is None or w.compress_ape is None:
        if p.kpool != 1:
            raise ValueError(f"the indexer without compress tensors pools single tokens (kpool 1), not {p.kpool}")
        gate, ape = ik.new_zeros(ik.shape), torch.zeros(1, p.head_dim, device=ik.device)
    else:
        gate, ape = F.linear(x, w.compress_gate), w.compress_ape
    head_w = F.linear(x, w.weights_proj).float() * p.heads ** -0.5
    return select(iq, ik, gate, head_w, ape, p, cu_seqlens, width, dtype)
