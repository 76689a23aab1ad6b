"""MoE routing and the clamped SwiGLU against transformers' Glm5NextTextTopkRouter / MoE / MLP, fp32.

Tolerance: norm-wise relative error <= 1e-6 (in practice 0); chosen experts equal as sets.
"""

from __future__ import annotations

import pytest
import torch
from helpers.ops_helpers import randomize, rel, text_config

from glmconv.errors import GlmconvError
from glmconv.ops.moe import RouterParams, mlp, route, routed, swiglu, swiglu_limit

TOL = 1e-6


def _moe(seed: int, **overrides):  # type: ignore[no-untyped-def]
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMoE

    cfg = text_config(**overrides)
    return cfg, randomize(Glm5NextTextMoE(cfg), seed)


def _params(cfg) -> RouterParams:  # type: ignore[no-untyped-def]
    return RouterParams(cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.n_group, cfg.topk_group,
                        cfg.norm_topk_prob)


def _expert(m):  # type: ignore[no-untyped-def]
    def get(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gate, up = m.experts.gate_up_proj[e].chunk(2, dim=0)
        return gate, up, m.experts.down_proj[e]
    return get


@pytest.mark.parametrize("overrides", [{}, {"n_group": 2, "topk_group": 1}, {"num_experts_per_tok": 3}],
                         ids=["tiny", "grouped", "top3"])


@torch.no_grad()
def test_routing_matches_transformers(overrides: dict) -> None:
    cfg, m = _moe(0, **overrides)
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, ids = route(x, m.gate.weight, m.gate.e_score_correction_bias, _params(cfg))
    _, want_w, want_ids = m.gate(x)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert rel(weights.gather(1, order), want_w.gather(1, want_order)) <= TOL


@torch.no_grad()
def test_bias_steers_selection_only() -> None:
    cfg, m = _moe(2)
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    bias = torch.zeros(cfg.n_routed_experts)
    bias[5] = 100.0  # expert 5 always chosen, but weighted by its own sigmoid score, not the bias
    weights, ids = route(x, m.gate.weight, bias, _params(cfg))
    assert bool((ids == 5).any(-1).all())
    scores = torch.sigmoid(x @ m.gate.weight.t())
    want = scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True) * cfg.routed_scaling_factor
    assert rel(weights, want) <= TOL


@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["inactive-clamp", "active-clamp"])
@torch.no_grad()
def test_moe_block_matches_transformers(scale: float) -> None:
    cfg, m = _moe(4)
    x = torch.randn(50, cfg.hidden_size, generator=torch.Generator().manual_seed(5)) * scale
    weights, ids = route(x, m.gate.weight, m.gate.e_score_correction_bias, _params(cfg))
    sh = m.shared_experts
    got = routed(x, weights, ids, _expert(m), 10.0) + mlp(x, sh.gate_proj.weight, sh.up_proj.weight,
                                                            sh.down_proj.weight, 10.0)
    assert rel(got, m(x[None])[0]) <= TOL
    active = bool((sh.up_proj(x).abs() > 10).any())
    assert active == (scale > 1)
    off = routed(x, weights, ids, _expert(m), None) + mlp(x, sh.gate_proj.weight, sh.up_proj.weight,
                                                           sh.down_proj.weight, None)
    assert (rel(off, got) > 1e-2) == active  # the missing clamp shows exactly when units exceed the limit


@torch.no_grad()
def test_dense_mlp_and_swiglu() -> None:
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP

    cfg = text_config()
    dense = randomize(Glm5NextTextMLP(cfg), 6)
    x = torch.randn(20, cfg.hidden_size, generator=torch.Generator().manual_seed(7)) * 20
    assert rel(mlp(x, dense.gate_proj.weight, dense.up_proj.weight, dense.down_proj.weight, 10.0), dense(x)) <= TOL
    g, u = torch.tensor([20.0, -20.0, 3.0]), torch.tensor([15.0, -15.0, 2.0])
    assert torch.equal(swiglu(g, u, 10.0), torch.nn.functional.silu(torch.tensor([10.0, -20.0, 3.0]))
                       * torch.tensor([10.0, -10.0, 2.0]))
    assert torch.equal(swiglu(g, u, None), torch.nn.functional.silu(g) * u)
    assert swiglu_limit("10") == 10.0 and swiglu_limit("off") is None
    with pytest.raises(GlmconvError, match="SwiGLU clamp"):
        swiglu_limit("7")
