"""KDA: the chunked gated delta rule against the naive recurrence, and the whole layer against transformers'
Glm5NextTextLinearAttention (run on each packed sequence alone), fp32.

Tolerance: norm-wise relative error <= 1e-5 (measured: ~3e-7).
"""

from __future__ import annotations

import pytest
import torch
from helpers.ops_helpers import cu, randomize, rel, text_config

from glmconv.ops.kda import (
    KdaParams,
    KdaTensors,
    chunk_kda,
    forget_gate,
    kda_layer,
    l2norm,
    recurrent_kda,
    segments,
    short_conv,
)

TOL = 1e-5
LENGTHS = (150, 1, 63, 64, 65, 7)  # chunk edges on both sides of 64, a single token, several chunks


def _module(seed: int = 0):  # type: ignore[no-untyped-def]
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    cfg = text_config()
    return cfg, randomize(Glm5NextTextLinearAttention(cfg, 0), seed)


def _tensors(m) -> KdaTensors:  # type: ignore[no-untyped-def]
    fg = m.forget_gate
    return KdaTensors(q_proj=m.q_proj.weight, k_proj=m.k_proj.weight, v_proj=m.v_proj.weight, conv=m.conv1d.weight,
                      f_a=fg.f_a_proj.weight, f_b=fg.f_b_proj.weight, g_a=m.g_a_proj.weight, g_b=m.g_b_proj.weight,
                      b_proj=m.b_proj.weight, a_log=fg.A_log, dt_bias=fg.dt_bias, o_norm=m.o_norm.weight,
                      o_proj=m.o_proj.weight)


def _params(cfg) -> KdaParams:  # type: ignore[no-untyped-def]
    return KdaParams(cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_lower_bound, cfg.rms_norm_eps)


def test_chunked_equals_naive_recurrence_on_packed_sequences() -> None:
    g = torch.Generator().manual_seed(0)
    t, h, k, v = sum(LENGTHS), 3, 16, 8
    q, kk = torch.randn(t, h, k, generator=g), torch.randn(t, h, k, generator=g)
    vv = torch.randn(t, h, v, generator=g)
    gate = -5 * torch.rand(t, h, k, generator=g)  # the safe-gate range [-5, 0]
    beta = torch.rand(t, h, generator=g)
    c = cu(*LENGTHS)
    naive = recurrent_kda(q, kk, vv, gate, beta, c)
    assert rel(chunk_kda(q, kk, vv, gate, beta, c), naive) <= TOL
    assert rel(chunk_kda(q, kk, vv, gate, beta, c, chunk=16), naive) <= TOL
    for s, e in segments(c):  # the state never crosses a boundary
        assert rel(recurrent_kda(q[s:e], kk[s:e], vv[s:e], gate[s:e], beta[s:e], cu(e - s)), naive[s:e]) <= 1e-6


@pytest.mark.parametrize("chunked", [True, False])
@torch.no_grad()
def test_layer_matches_transformers_per_packed_sequence(chunked: bool) -> None:
    cfg, m = _module(1)
    x = torch.randn(sum(LENGTHS), cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    c = cu(*LENGTHS)
    got = kda_layer(x, _tensors(m), _params(cfg), c, chunked=chunked)
    for s, e in segments(c):
        assert rel(got[s:e], m(x[s:e][None])[0]) <= TOL, (s, e)


@torch.no_grad()
def test_pieces_match_transformers() -> None:
    from transformers.models.glm5_next.modeling_glm5_next import causal_conv1d_fn
    from transformers.models.glm5_next.modeling_glm5_next import l2norm as hf_l2norm

    cfg, m = _module(3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, cfg.hidden_size, generator=g)
    assert torch.equal(forget_gate(m.forget_gate.f_b_proj(m.forget_gate.f_a_proj(x)), m.forget_gate.A_log,
                                   m.forget_gate.dt_bias, _params(cfg)), m.forget_gate(x[None])[0])
    z = torch.randn(40, 3 * cfg.linear_num_heads * cfg.linear_head_dim, generator=g)
    want = causal_conv1d_fn(z.t()[None], m.conv1d.weight.squeeze(1), activation="silu")[0].t()
    assert rel(short_conv(z, m.conv1d.weight, cu(40)), want) <= 1e-6  # multiply-adds vs conv1d: rounding only
    assert torch.equal(l2norm(z), hf_l2norm(z))


def test_conv_restarts_at_each_boundary() -> None:
    z = torch.randn(12, 6, generator=torch.Generator().manual_seed(5))
    w = torch.randn(6, 1, 4, generator=torch.Generator().manual_seed(6))
    packed = short_conv(z, w, cu(5, 7))
    assert torch.equal(packed[5:], short_conv(z[5:], w, cu(7)))
