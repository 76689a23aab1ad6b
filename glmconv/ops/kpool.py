"""The kpool DSA indexer: which past tokens each query attends to, as a torch reference.

iq = wq_b(q_resid) [T, n, d] (q_resid normalised on the serve side, raw q_a_proj output in a naive Megatron
port); ik = LayerNorm(wk(x); weight, bias, eps 1e-6) [T, d]; gate = x @ compress_gate^T [T, d].
Per sequence, pools of `kpool` consecutive tokens from its first token; only complete pools are candidates:
  pool_key[c] = sum_j softmax_j(gate_j[c] + ape[j][c]) * ik_j[c]   (fp32)
  score(t, p) = sum_h w_h(t) * relu(iq_h(t) . pool_key(p) * d^-0.5),  w = weights_proj(x) * n^-0.5 (fp32)
A pool is visible to query t when its last token is <= t. The top min(index_topk / kpool, #pools) pools by
score (descending) expand to their token ids, -1 for a selected pool that is not visible; with
always_select_tail the query's incomplete tail pool (up to kpool - 1 tokens) follows; -1 pads to the width
index_topk (+ kpool - 1 with the tail). This is transformers' `Glm5NextTextIndexer` on an unpadded sequence,
so a sequence no longer than index_topk selects every visible token. Packed sequences never cross.

Without compress tensors (`compress_gate` / `compress_ape` None) and kpool 1, no tail, it is megatron-core's
token-level DSA indexer (what the `indexer_kpool=off` convention runs): pool keys are the tokens' own ik, and
each query takes its top index_topk visible tokens. That selects the same set as the kpool indexer while a
sequence is at most index_topk tokens long (both then take every visible token), and differs past that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmconv.ops.kda import segments

if TYPE_CHECKING:
    import torch


K_NORM_EPS = 1e-6
SCORE_BUDGET = 256 << 20  # bytes of fp32 [queries, heads, pools] scores per block


@dataclass(frozen=True)
class KpoolParams:
    """Per-config constants of the indexer."""

    heads: int
    head_dim: int
    topk: int
    kpool: int
    select_tail: bool

    @property
    def width(self) -> int:
        return self.topk + (self.kpool - 1 if self.select_tail else 0)


@dataclass(frozen=True)
class IndexerTensors:
    """The indexer's weights (the names follow transformers' module)."""

    wq_b: torch.Tensor
    wk: torch.Tensor
    k_norm_weight: torch.Tensor
    k_norm_bias: torch.Tensor
    weights_proj: torch.Tensor
    compress_gate: torch.Tensor | None = None  # None: the token-level indexer (kpool 1)
    compress_ape: torch.Tensor | None = None


def token_params(p: KpoolParams) -> KpoolParams:
    """megatron-core's token-level indexer as kpool parameters: pools of one token, no tail, top index_topk."""
    return KpoolParams(p.heads, p.head_dim, p.topk, kpool=1, select_tail=False)


def kpool_topk(x: torch.Tensor, q_resid: torch.Tensor, w: IndexerTensors, p: KpoolParams,
               cu_seqlens: torch.Tensor) -> torch.Tensor:
    """x [T, hidden], q_resid [T, q_lora] -> LongTensor [T, width] of packed token ids, -1 = none."""
    import torch

    iq, ik, gate, head_w = _projections(x, q_resid, w, p)
    out = torch.full((x.shape[0], p.width), -1, dtype=torch.long, device=x.device)
    for s, e in segments(cu_seqlens):
        ids = _sequence_topk(iq[s:e], ik[s:e], None if gate is None else gate[s:e], head_w[s:e], w.compress_ape, p)
        out[s:e] = torch.where(ids >= 0, ids + s, ids)
    return out


def selection_scores(x: torch.Tensor, q_resid: torch.Tensor, w: IndexerTensors, p: KpoolParams,
                     cu_seqlens: torch.Tensor, *selections: torch.Tensor) -> list[torch.Tensor]:
    """The reference's score of each selected id: per selection [T, W'] of packed token ids, [T, W'] fp32 scores of
    the pool holding each id for that query; NaN for -1, for a pool the query cannot see (its tail too) and for
    an id outside its sequence. Two selections that differ only where their scores tie differ by rounding alone."""
    import torch

    iq, ik, gate, head_w = _projections(x, q_resid, w, p)
    outs = [torch.full(sel.shape, float("nan"), dtype=torch.float32, device=x.device) for sel in selections]
    for s, e in segments(cu_seqlens):
        keys = pool_keys(ik[s:e], None if gate is None else gate[s:e], w.compress_ape, p.kpool)
        if keys.shape[0] == 0:
            continue
        pos = torch.arange(e - s, device=x.device)
        step = max(1, SCORE_BUDGET // max(1, 4 * p.heads * keys.shape[0]))
        for b in range(0, e - s, step):
            rows = slice(s + b, min(s + b + step, e))
            scores, visible = _visible_scores(iq[rows], head_w[rows], keys, pos[b:b + step], p.kpool)
            scores = scores.masked_fill(~visible, float("nan"))
            for out, sel in zip(outs, selections):
                ids = sel[rows].long() - s
                pool = torch.div(ids, p.kpool, rounding_mode="floor")
                ok = (ids >= 0) & (pool < keys.shape[0])
                got = scores.gather(1, pool.clamp(0, keys.shape[0] - 1))
                out[rows] = torch.where(ok, got, float("nan"))
    return outs


def _projections(x: torch.Tensor, q_resid: torch.Tensor, w: IndexerTensors,
                 p: KpoolParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(iq [T, n, d], ik [T, d], gate [T, d] or None, head weights [T, n] fp32): the indexer's projections."""
    import torch.nn.functional as F

    iq = F.linear(q_resid, w.wq_b).view(x.shape[0], p.heads, p.head_dim)
    ik = F.layer_norm(F.linear(x, w.wk), (p.head_dim,), w.k_norm_weight, w.k_norm_bias, K_NORM_EPS)
    if w.compress_gate is None and p.kpool != 1:
        raise ValueError(f"the indexer without compress tensors pools single tokens (kpool 1), not {p.kpool}")
    gate = None if w.compress_gate is None else F.linear(x, w.compress_gate)
    return iq, ik, gate, F.linear(x, w.weights_proj).float() * p.heads ** -0.5


def pool_keys(ik: torch.Tensor, gate: torch.Tensor | None, ape: torch.Tensor | None, kpool: int) -> torch.Tensor:
    """[P, d] fp32 keys of the complete pools: softmax over each pool's tokens of gate + ape, per channel.

    gate None (the token-level indexer, kpool 1): each token's own ik, which a one-token softmax also gives."""
    if gate is None or ape is None:
        return ik.float()
    n = ik.shape[0] // kpool
    keys = ik[: n * kpool].float().view(n, kpool, ik.shape[-1])
    logits = gate[: n * kpool].float().view(n, kpool, gate.shape[-1]) + ape.float()
    return (logits.softmax(dim=1) * keys).sum(dim=1)


def pool_scores(iq: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[S, P] = sum_h w_h relu(iq_h . key_p * d^-0.5), fp32."""
    import torch
    import torch.nn.functional as F

    scores = F.relu(torch.matmul(iq.float(), keys.t()) * head_dim ** -0.5)  # [S, n, P]
    return torch.matmul(head_w.unsqueeze(-2), scores).squeeze(-2)


def _sequence_topk(iq: torch.Tensor, ik: torch.Tensor, gate: torch.Tensor | None, head_w: torch.Tensor,
                   ape: torch.Tensor | None, p: KpoolParams) -> torch.Tensor:
    """One sequence's [S, width] local token ids, scored in blocks of queries (bounded memory)."""
    import torch

    keys = pool_keys(ik, gate, ape, p.kpool)
    pos = torch.arange(iq.shape[0], device=iq.device)
    step = max(1, SCORE_BUDGET // max(1, 4 * p.heads * keys.shape[0]))
    blocks = [_select(iq[s:s + step], head_w[s:s + step], keys, pos[s:s + step], p)
              for s in range(0, iq.shape[0], step)]
    return torch.cat(blocks) if blocks else torch.empty(0, p.width, dtype=torch.long, device=iq.device)


def _select(iq: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor,
            p: KpoolParams) -> torch.Tensor:
    """Queries at positions `pos`: the best visible pools (best first) expanded to ids, then the tail."""
    import torch
    import torch.nn.functional as F

    n_pools = keys.shape[0]
    scores, visible = _visible_scores(iq, head_w, keys, pos, p.kpool)
    scores = scores.masked_fill(~visible, torch.finfo(torch.float32).min)
    chosen = scores.topk(min(p.topk // p.kpool, n_pools), dim=-1).indices  # [q, k], best first
    pool_start = torch.arange(n_pools, device=iq.device) * p.kpool
    ids = (pool_start[chosen][..., None] + torch.arange(p.kpool, device=iq.device)).flatten(-2)
    ok = visible.gather(-1, chosen).repeat_interleave(p.kpool, dim=-1)
    ids = ids.masked_fill(~ok, -1)
    if p.select_tail:
        ids = torch.cat([ids, _tail(pos, p.kpool)], dim=-1)
    return F.pad(ids, (0, max(0, p.width - ids.shape[-1])), value=-1)[:, : p.width]


def _visible_scores(iq: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor,
                    kpool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([q, P] scores of every complete pool, [q, P] whether the query at `pos` sees it: its last token <= pos)."""
    import torch

    pool_start = torch.arange(keys.shape[0], device=iq.device) * kpool
    visible = (pool_start + kpool - 1)[None, :] <= pos[:, None]
    return pool_scores(iq, keys, head_w, iq.shape[-1]), visible


def _tail(pos: torch.Tensor, kpool: int) -> torch.Tensor:
    """[S, kpool - 1]: the query's incomplete pool (tokens after its last complete pool), -1 padded."""
    import torch

    count = (pos + 1) % kpool
    offsets = torch.arange(kpool - 1, device=pos.device)
    tail = (pos + 1 - count)[:, None] + offsets
    return tail.masked_fill(offsets[None, :] >= count[:, None], -1)
