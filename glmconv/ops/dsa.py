"""DSA core: NoPE MLA attention over the indexer-selected positions, as a torch reference.

q [T, H, Dn] (q_b_proj of the normalised q_resid), latent c [T, R] (kv_a_layernorm output), kv_b [H*(Dn+Dv), R]
viewed [H, Dn + Dv, R]. For each query t, over its selected ids j (`topk[t]`, -1 = none):
  score_hj = q_h . (W_uk,h c_j) * Dn^-0.5;  p = softmax_j(score);  o_h = sum_j p_hj W_uv,h c_j.
Computed absorbed (q_h W_uk,h against the gathered latents, the way sglang and the SparseMLA kernel do),
in fp32, chunked over queries so the gather stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmconv.errors import GlmconvError
from glmconv.ops import rms_norm
from glmconv.ops.kpool import IndexerTensors, KpoolParams, kpool_topk

if TYPE_CHECKING:
    import torch


INDEXER_QUERIES = ("normed", "raw")
GATHER_BUDGET = 256 << 20  # bytes of gathered fp32 latents per query chunk


@dataclass(frozen=True)
class DsaTensors:
    """One DSA layer's weights; `indexer` is None on a layer that reuses another layer's top-k."""

    q_a: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: torch.Tensor
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    o_proj: torch.Tensor
    indexer: IndexerTensors | None


@dataclass(frozen=True)
class DsaParams:
    """Per-config constants of the MLA part."""

    heads: int
    nope: int
    v_dim: int
    rms_eps: float


def dsa_layer(x: torch.Tensor, w: DsaTensors, p: DsaParams, kp: KpoolParams, cu_seqlens: torch.Tensor,
              indexer_query: str = "normed", topk: torch.Tensor | None = None,
              indexer: Callable[..., torch.Tensor] = kpool_topk,
              attend: Callable[..., torch.Tensor] | None = None,
              replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSA sub-block: x [T, hidden] (input-normed) -> (out [T, hidden], top-k ids [T, W]).

    `indexer_query`: the indexer reads the normalised q_resid (`normed`, serve) or the raw q_a_proj output
    (`raw`, what a port that fuses q_a_layernorm into linear_q_up_proj feeds it). `topk` given: reuse it.
    `indexer` / `attend`: the kpool selection and the sparse attention (the references here by default; the
    GPU kernels of glmconv.kernels have the same signatures). `replay` given (indexer replay): attend over those
    ids instead; the returned top-k is still the layer's own selection.
    """
    import torch.nn.functional as F

    if indexer_query not in INDEXER_QUERIES:
        raise GlmconvError(f"unknown indexer query {indexer_query!r} (choose from {', '.join(INDEXER_QUERIES)})")
    q_raw = F.linear(x, w.q_a)
    q_resid = rms_norm(q_raw, w.q_a_norm, p.rms_eps)
    q = F.linear(q_resid, w.q_b).view(x.shape[0], p.heads, p.nope)
    latent = rms_norm(F.linear(x, w.kv_a), w.kv_a_norm, p.rms_eps)
    if topk is None:
        if w.indexer is None:
            raise GlmconvError("a DSA layer without its own indexer needs the top-k of a previous layer")
        topk = indexer(x, q_resid if indexer_query == "normed" else q_raw, w.indexer, kp, cu_seqlens)
    used = topk if replay is None else replay.to(topk.device)
    o = (attend or sparse_mla)(q, latent, w.kv_b, used, p.v_dim, p.nope ** -0.5)
    return F.linear(o.reshape(x.shape[0], -1), w.o_proj), topk


def sparse_mla(q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor, topk: torch.Tensor, v_dim: int,
               scale: float) -> torch.Tensor:
    """-> [T, H, Dv] in q.dtype; `topk` [T, W] holds token ids into `latent` (-1 = not selected)."""
    import torch

    heads, nope = q.shape[1], q.shape[2]
    w = kv_b.float().view(heads, nope + v_dim, -1)
    q_abs = torch.einsum("thd,hdr->thr", q.float(), w[:, :nope])
    c = latent.float()
    out = torch.empty(q.shape[0], heads, v_dim, dtype=torch.float32, device=q.device)
    step = max(1, GATHER_BUDGET // max(1, topk.shape[1] * c.shape[1] * 4))
    for s in range(0, q.shape[0], step):
        o_lat = _attend(q_abs[s:s + step], c, topk[s:s + step].long(), scale)
        out[s:s + step] = torch.einsum("thr,hvr->thv", o_lat, w[:, nope:])
    return out.to(q.dtype)


def _attend(q_abs: torch.Tensor, c: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention of absorbed queries [t, H, R] over their gathered latents -> [t, H, R]."""
    import torch

    valid = ids >= 0
    sel = c[ids.clamp(min=0)]  # [t, W, R]
    scores = torch.einsum("thr,twr->thw", q_abs, sel) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.nan_to_num(torch.softmax(scores, dim=-1))  # a row with nothing selected attends to nothing
    return torch.einsum("thw,twr->thr", p, sel)
