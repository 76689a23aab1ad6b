"""The kpool indexer against transformers' Glm5NextTextIndexer (each packed sequence run alone), fp32.

The ids must be EQUAL, order included (best pool first, then the tail, -1 padding), for sequences shorter
than, equal to and several times longer than index_topk, with and without the tail.
"""

from __future__ import annotations

import pytest
import torch
from helpers.ops_helpers import cu, indexer_tensors, kpool_params, randomize, rel, text_config

from glmconv.ops.kda import segments
from glmconv.ops.kpool import kpool_topk, pool_keys

LENGTHS = (100, 1, 3, 4, 16, 17, 45)  # index_topk = 16, kpool = 4 in the tiny preset


def _indexer(seed: int, **overrides):  # type: ignore[no-untyped-def]
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = text_config(**overrides)
    return cfg, randomize(Glm5NextTextIndexer(cfg, 3), seed)


def _inputs(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    return torch.randn(t, cfg.hidden_size, generator=g), torch.randn(t, cfg.q_lora_rank, generator=g)


def _local(ids: torch.Tensor, start: int) -> torch.Tensor:
    return torch.where(ids >= 0, ids - start, ids)


@pytest.mark.parametrize("overrides", [
    {},
    {"index_kpool_always_select_tail": False},
    {"index_topk": 24, "index_kpool": 8, "index_n_heads": 8},
    {"index_kpool": 1},
], ids=["tiny", "no-tail", "kpool8", "kpool1"])


@torch.no_grad()
def test_ids_equal_transformers_per_packed_sequence(overrides: dict) -> None:
    cfg, ix = _indexer(0, **overrides)
    x, q_resid = _inputs(cfg, 1)
    c = cu(*LENGTHS)
    got = kpool_topk(x, q_resid, indexer_tensors(ix), kpool_params(cfg), c)
    assert got.shape == (x.shape[0], kpool_params(cfg).width)
    for s, e in segments(c):
        want = ix(x[s:e][None], q_resid[s:e][None], torch.ones(1, e - s, dtype=torch.bool), None)[0]
        assert torch.equal(_local(got[s:e], s), want.long()), (s, e)


@torch.no_grad()
def test_query_blocks_do_not_change_the_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.ops.kpool as kpool

    cfg, ix = _indexer(5)
    x, q_resid = _inputs(cfg, 6)
    c = cu(*LENGTHS)
    whole = kpool_topk(x, q_resid, indexer_tensors(ix), kpool_params(cfg), c)
    monkeypatch.setattr(kpool, "SCORE_BUDGET", 4 * cfg.index_n_heads * 7)  # blocks of a few queries
    assert torch.equal(kpool_topk(x, q_resid, indexer_tensors(ix), kpool_params(cfg), c), whole)


@torch.no_grad()
def test_selection_rules() -> None:
    cfg, ix = _indexer(2)
    p = kpool_params(cfg)
    x, q_resid = _inputs(cfg, 3)
    c = cu(*LENGTHS)
    got = kpool_topk(x, q_resid, indexer_tensors(ix), p, c)
    for s, e in segments(c):
        for t in range(e - s):
            ids = _local(got[s + t], s)
            sel = sorted(i for i in ids.tolist() if i >= 0)
            assert len(sel) == len(set(sel)) and all(0 <= i <= t for i in sel)  # causal, no duplicates
            if e - s <= p.topk:
                assert sel == list(range(t + 1))  # short sequences see every visible token
            else:
                assert len(sel) == min(t + 1, p.topk + (t + 1) % p.kpool)  # top pools + the incomplete tail


def test_pool_keys_are_a_softmax_weighted_average() -> None:
    g = torch.Generator().manual_seed(4)
    ik, gate, ape = torch.randn(10, 6, generator=g), torch.randn(10, 6, generator=g), torch.randn(4, 6, generator=g)
    keys = pool_keys(ik, gate, ape, 4)
    assert keys.shape == (2, 6)  # the incomplete third pool is no candidate
    for p in range(2):
        w = torch.softmax(gate[4 * p:4 * p + 4] + ape, dim=0)
        assert rel(keys[p], (w * ik[4 * p:4 * p + 4]).sum(0)) <= 1e-6


# ---- the token-level indexer (indexer_kpool=off: megatron-core's DSA indexer) ---------------------------------

@torch.no_grad()
def test_token_level_indexer_takes_the_best_visible_tokens() -> None:
    """No compress tensors, kpool 1, no tail: each query's top index_topk visible tokens by the indexer score,
    best first (a brute-force score per token, no pooling), -1 past the visible ones."""
    import dataclasses

    import torch.nn.functional as F

    from glmconv.ops.kpool import K_NORM_EPS, token_params

    cfg, ix = _indexer(7)
    p = token_params(kpool_params(cfg))
    w = dataclasses.replace(indexer_tensors(ix), compress_gate=None, compress_ape=None)
    assert (p.kpool, p.select_tail, p.width) == (1, False, cfg.index_topk)
    x, q_resid = _inputs(cfg, 8)
    c = cu(*LENGTHS)
    got = kpool_topk(x, q_resid, w, p, c)
    iq = F.linear(q_resid, w.wq_b).view(-1, p.heads, p.head_dim)
    ik = F.layer_norm(F.linear(x, w.wk), (p.head_dim,), w.k_norm_weight, w.k_norm_bias, K_NORM_EPS)
    head_w = F.linear(x, w.weights_proj) * p.heads ** -0.5
    for s, e in segments(c):
        for t in range(e - s):
            score = (head_w[s + t, :, None] * F.relu(iq[s + t] @ ik[s:s + t + 1].t() * p.head_dim ** -0.5)).sum(0)
            ids = _local(got[s + t], s).tolist()
            n = min(p.topk, t + 1)
            assert ids[n:] == [-1] * (p.topk - n) and len(set(ids[:n])) == n and min(ids[:n]) >= 0, (s, t)
            chosen = score[ids[:n]]
            assert bool((chosen[:-1] >= chosen[1:]).all()), (s, t)  # best first (ties in either order)
            rest = [j for j in range(t + 1) if j not in ids[:n]]
            assert not rest or float(chosen.min()) >= float(score[rest].max()), (s, t)  # the best n


@torch.no_grad()
def test_token_level_and_kpool_select_the_same_tokens_only_up_to_index_topk() -> None:
    import dataclasses

    from glmconv.ops.kpool import token_params

    cfg, ix = _indexer(9)
    x, q_resid = _inputs(cfg, 10)
    c = cu(*LENGTHS)
    pooled = kpool_topk(x, q_resid, indexer_tensors(ix), kpool_params(cfg), c)
    token = kpool_topk(x, q_resid, dataclasses.replace(indexer_tensors(ix), compress_gate=None, compress_ape=None),
                       token_params(kpool_params(cfg)), c)
    for s, e in segments(c):
        same = all(set(pooled[t].tolist()) - {-1} == set(token[t].tolist()) - {-1} for t in range(s, e))
        assert same == (e - s <= cfg.index_topk), (s, e)
    with pytest.raises(ValueError, match="kpool 1"):
        kpool_topk(x, q_resid, dataclasses.replace(indexer_tensors(ix), compress_gate=None), kpool_params(cfg), c)
