"""mHC against transformers' Glm5NextTextHyperConnection / HyperHead and the decoder layer's mix, fp32.

Tolerance: norm-wise relative error <= 1e-6 (the same ops in the same order: in practice 0).
"""

from __future__ import annotations

import pytest
import torch
from helpers.ops_helpers import randomize, rel, text_config

from glmconv.errors import GlmconvError
from glmconv.ops.mhc import HcParams, flat_rms, hc_post, hc_pre, head_learned, head_mean, sinkhorn

TOL = 1e-6


def _hc(seed: int = 0):  # type: ignore[no-untyped-def]
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    cfg = text_config()
    return cfg, randomize(Glm5NextTextHyperConnection(cfg), seed)


def _params(cfg) -> HcParams:  # type: ignore[no-untyped-def]
    return HcParams(cfg.hc_mult, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)


@pytest.mark.parametrize("scale", [1.0, 0.01, 30.0])
@torch.no_grad()
def test_pre_matches_transformers(scale: float) -> None:
    cfg, hc = _hc()
    x = torch.randn(1, 37, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * scale
    post, comb, collapsed = hc(x)
    mp, mc, mcol = hc_pre(x[0], hc.fn, hc.base, hc.scale, _params(cfg), "reference")
    assert rel(mp, post[0]) <= TOL and rel(mc, comb[0]) <= TOL and rel(mcol, collapsed[0]) <= TOL


class _Fixed(torch.nn.Module):
    """Stands in for a sub-block: returns a fixed output, so the layer's own mHC lines are what is tested."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.out


@pytest.mark.parametrize(("dtype", "mix"), [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@torch.no_grad()
def test_decoder_layer_hc_pre_and_post_match_transformers(dtype: torch.dtype, mix: str) -> None:
    """transformers' whole decoder layer (attention and MLP replaced by fixed outputs) = glmconv's pre/post mix."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

    cfg = text_config()
    layer = randomize(Glm5NextTextDecoderLayer(cfg, 0), 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 29, cfg.hc_mult, cfg.hidden_size, generator=g).to(dtype)
    y, z = (torch.randn(1, 29, cfg.hidden_size, generator=g).to(dtype) for _ in range(2))
    layer.self_attn, layer.mlp = _Fixed(y), _Fixed(z)
    want, _ = layer(x)
    p = _params(cfg)
    post, comb, _ = hc_pre(x[0], layer.attn_hc.fn, layer.attn_hc.base, layer.attn_hc.scale, p)
    mid = hc_post(y[0], x[0], post, comb, mix)
    post, comb, _ = hc_pre(mid, layer.ffn_hc.fn, layer.ffn_hc.base, layer.ffn_hc.scale, p)
    assert torch.equal(hc_post(z[0], mid, post, comb, mix), want[0])


def test_bf16_mix_coefficients_differ_from_the_fp32_mix() -> None:
    cfg, hc = _hc(2)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(29, cfg.hc_mult, cfg.hidden_size, generator=g), torch.randn(29, cfg.hidden_size, generator=g)
    post, comb, _ = hc_pre(x, hc.fn, hc.base, hc.scale, _params(cfg))
    assert rel(hc_post(y, x, post, comb, "bf16"), hc_post(y, x, post, comb, "fp32")) > 1e-4


def test_megatron_rms_form_is_eps_outside_the_root() -> None:
    flat = torch.randn(11, 256, generator=torch.Generator().manual_seed(4)).double()
    want = flat / (flat.square().mean(-1, keepdim=True).sqrt() + 1e-6)
    assert rel(flat_rms(flat.float(), "megatron", 1e-5), want) <= TOL
    small = flat.float() * 3e-3  # GLM-5.3's residual scale: eps 1e-5 inside the root is not negligible
    assert rel(flat_rms(small, "megatron", 1e-5), flat_rms(small, "reference", 1e-5)) > 0.1
    with pytest.raises(GlmconvError, match="proj-RMS"):
        flat_rms(flat.float(), "other", 1e-5)


def test_sinkhorn_is_doubly_stochastic() -> None:
    comb = torch.softmax(torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(5)), -1) + 1e-6
    out = sinkhorn(comb, 20, 1e-6)  # ends on a column normalisation; rows converge for a mild matrix
    assert torch.allclose(out.sum(-1), torch.ones(5, 4), atol=1e-5)
    assert torch.allclose(out.sum(-2), torch.ones(5, 4), atol=1e-5)


def test_head_mean_matches_transformers_and_learned_is_a_weighted_sum() -> None:
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperHead

    x = torch.randn(7, 4, 32, generator=torch.Generator().manual_seed(6))
    assert torch.equal(head_mean(x), Glm5NextTextHyperHead()(x[None])[0])
    fn, base, scale = torch.zeros(4, 128), torch.full((4,), 50.0), torch.ones(1)  # sigmoid(50) = 1: a plain sum
    assert rel(head_learned(x, fn, base, scale, 1e-5, 0.0), x.sum(1)) <= TOL


def test_unknown_mix_is_refused() -> None:
    x = torch.ones(2, 4, 8)
    with pytest.raises(GlmconvError, match="mix precision"):
        hc_post(torch.ones(2, 8), x, torch.ones(2, 4), torch.ones(2, 4, 4), "fp16")
