"""Manifold-constrained hyper-connections (mHC): the residual is `hc_mult` streams X [T, n, H].

pre (per site): flat = X.view(T, n*H) in fp32, normalised by
  `reference` (HF/sglang): flat * rsqrt(mean(flat^2) + rms_eps), or
  `megatron`  (train):     flat / (sqrt(mean(flat^2)) + 1e-6);
mixes = flat @ fn^T [T, (2+n)*n]; pre = sigmoid(m[:n]*scale0 + base[:n]) + hc_eps;
post = 2*sigmoid(m[n:2n]*scale1 + base[n:2n]); comb = softmax(m[2n:]*scale2 + base[2n:]).view(n, n) + hc_eps,
one column normalisation, then `sinkhorn_iters - 1` rounds of row then column normalisation (eps hc_eps);
collapsed = sum_i pre_i X_i.
post (per site): X'_j = post_j * y + sum_i comb[i, j] X_i, with post/comb cast to bf16 first (`bf16`, HF)
or the whole mix in fp32 (`fp32`, sglang).
head: the streams contracted by a plain mean (`mean`, the release) or, with `hc_head_*` tensors, by a
learned pre-style weighting (`learned`, DeepSeek-V4 style: sum_i (sigmoid(m_i*scale + base_i) + hc_eps) X_i).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmconv.errors import GlmconvError

if TYPE_CHECKING:
    import torch


RMS_FORMS = ("reference", "megatron")
MIX_DTYPES = ("bf16", "fp32")
MEGATRON_RMS_EPS = 1e-6


@dataclass(frozen=True)
class HcParams:
    """The per-config constants of one hyper-connection site."""

    hc_mult: int
    rms_eps: float
    hc_eps: float
    sinkhorn_iters: int


def flat_rms(flat: torch.Tensor, form: str, rms_eps: float) -> torch.Tensor:
    """The unweighted RMS normalisation of the flattened streams (fp32 in, fp32 out)."""
    import torch

    if form == "reference":
        return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    if form == "megatron":
        return flat / (flat.square().mean(-1, keepdim=True).sqrt() + MEGATRON_RMS_EPS)
    raise GlmconvError(f"unknown proj-RMS form {form!r} (choose from {', '.join(RMS_FORMS)})")


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """One column normalisation, then `iters - 1` rounds of row then column normalisation."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, p: HcParams,
           form: str = "reference") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams [T, n, H] -> (post [T, n], comb [T, n, n], collapsed [T, H] in x.dtype); coefficients fp32."""
    import torch
    import torch.nn.functional as F

    n = p.hc_mult
    flat = flat_rms(x.reshape(x.shape[0], -1).float(), form, p.rms_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = torch.split(mixes, [n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = torch.split(base.float(), [n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + p.hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s[2] + comb_b.view(n, n), dim=-1) + p.hc_eps
    comb = sinkhorn(comb, p.sinkhorn_iters, p.hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def hc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            mix_dtype: str = "fp32") -> torch.Tensor:
    """X'_j = post_j * y + sum_i comb[i, j] X_i -> [T, n, H] in residual.dtype."""
    import torch

    dtype = residual.dtype
    if mix_dtype == "bf16":  # HF: coefficients rounded to bf16, the mix in the activation dtype
        p, c = post.to(torch.bfloat16).to(dtype), comb.to(torch.bfloat16).to(dtype)
        return p.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(c.transpose(-1, -2), residual)
    if mix_dtype == "fp32":  # sglang: the whole mix in fp32
        out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), residual.float())
        return out.to(dtype)
    raise GlmconvError(f"unknown hc mix precision {mix_dtype!r} (choose from {', '.join(MIX_DTYPES)})")


def head_mean(x: torch.Tensor) -> torch.Tensor:
    """The release's output contraction: the plain mean of the streams."""
    return x.mean(dim=1)


def head_learned(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float,
                 hc_eps: float, form: str = "reference") -> torch.Tensor:
    """Learned contraction (needs `hc_head_*` tensors): sum_i (sigmoid(m_i * scale + base_i) + hc_eps) X_i."""
    import torch
    import torch.nn.functional as F

    flat = flat_rms(x.reshape(x.shape[0], -1).float(), form, rms_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float().reshape(-1)[0] + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
