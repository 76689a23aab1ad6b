"""DSA attention (indexer + NoPE MLA over the selected positions) against transformers' Glm5NextTextAttention,
each packed sequence run alone, fp32; and the sparse MLA core against a dense float64 masked softmax.

Tolerance: norm-wise relative error <= 1e-5 (measured: ~3e-7; the core is computed absorbed).
"""

from __future__ import annotations

import pytest
import torch
from helpers.ops_helpers import cu, indexer_tensors, kpool_params, randomize, rel, text_config

from glmconv.errors import GlmconvError
from glmconv.ops import rms_norm
from glmconv.ops.dsa import DsaParams, DsaTensors, dsa_layer, sparse_mla
from glmconv.ops.kda import segments

TOL = 1e-5
LENGTHS = (101, 7, 16, 3, 64)  # index_topk 16: short, exactly topk, and several times topk


def _attention(seed: int):  # type: ignore[no-untyped-def]
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    cfg = text_config()
    return cfg, randomize(Glm5NextTextAttention(cfg, 3), seed)


def _tensors(m) -> DsaTensors:  # type: ignore[no-untyped-def]
    return DsaTensors(q_a=m.q_a_proj.weight, q_a_norm=m.q_a_layernorm.weight, q_b=m.q_b_proj.weight,
                      kv_a=m.kv_a_proj_with_mqa.weight, kv_a_norm=m.kv_a_layernorm.weight, kv_b=m.kv_b_proj.weight,
                      o_proj=m.o_proj.weight, indexer=indexer_tensors(m.indexer))


def _params(cfg) -> DsaParams:  # type: ignore[no-untyped-def]
    return DsaParams(cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.rms_norm_eps)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_layer_matches_transformers_per_packed_sequence(impl: str) -> None:
    cfg, m = _attention(1)
    m.config._attn_implementation = impl
    x = torch.randn(sum(LENGTHS), cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    c = cu(*LENGTHS)
    out, topk = dsa_layer(x, _tensors(m), _params(cfg), kpool_params(cfg), c)
    for s, e in segments(c):
        ones = torch.ones(1, e - s, dtype=torch.bool)
        assert rel(out[s:e], m(x[s:e][None], attention_mask=ones)[0][0]) <= TOL, (s, e)
        want = m.indexer(x[s:e][None], m.q_a_layernorm(m.q_a_proj(x[s:e][None])), ones, None)[0]
        assert torch.equal(torch.where(topk[s:e] >= 0, topk[s:e] - s, -1), want.long())


@torch.no_grad()
def test_raw_indexer_query_feeds_the_unnormalised_q() -> None:
    cfg, m = _attention(3)
    x = torch.randn(70, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    _, raw = dsa_layer(x, _tensors(m), _params(cfg), kpool_params(cfg), cu(70), indexer_query="raw")
    want = m.indexer(x[None], m.q_a_proj(x[None]), torch.ones(1, 70, dtype=torch.bool), None)[0]
    assert torch.equal(raw, want.long())
    _, normed = dsa_layer(x, _tensors(m), _params(cfg), kpool_params(cfg), cu(70))
    assert not torch.equal(raw, normed)  # the q_a_layernorm weight turns the query: top-k changes past topk
    with pytest.raises(GlmconvError, match="indexer query"):
        dsa_layer(x, _tensors(m), _params(cfg), kpool_params(cfg), cu(70), indexer_query="fused")


def test_sparse_mla_equals_dense_masked_softmax() -> None:
    g = torch.Generator().manual_seed(5)
    t, h, nope, v, r, w = 30, 3, 8, 6, 10, 9
    q, latent = torch.randn(t, h, nope, generator=g), torch.randn(t, r, generator=g)
    kv_b = torch.randn(h * (nope + v), r, generator=g)
    # each query: up to w distinct causal ids in random order, -1 where it has fewer
    topk = torch.stack([torch.cat([torch.randperm(i + 1, generator=g), torch.full((w,), -1)])[:w] for i in range(t)])
    got = sparse_mla(q, latent, kv_b, topk, v, nope ** -0.5)
    kv = (latent.double() @ kv_b.double().t()).view(t, h, nope + v)
    scores = torch.einsum("thd,shd->hts", q.double(), kv[..., :nope]) * nope ** -0.5
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        mask[i, topk[i][topk[i] >= 0]] = True
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    want = torch.einsum("hts,shv->thv", p, kv[..., nope:])
    assert rel(got, want) <= 1e-6


def test_rms_norm_matches_transformers() -> None:
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNorm

    norm = randomize(Glm5NextTextRMSNorm(24, eps=1e-5), 6)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(7))
    assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))
