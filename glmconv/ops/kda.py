"""KDA (Kimi delta attention), the GLM-5.3 linear-attention layer, as torch references that run on a CPU.

Layer: q, k, v = proj(x); causal depthwise short conv (kernel 4, no bias) + SiLU over cat(q, k, v);
g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)) in fp32 (a log-decay per key channel);
beta = sigmoid(b_proj(x)); q, k l2-normalised x / sqrt(sum x^2 + 1e-6), q scaled by head_dim^-0.5;
gated delta rule with an fp32 state S [K, V] per head:
  S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t;
out = o_proj(RMSNorm(o; o_norm, eps) * sigmoid(g_b(g_a(x)))). This is fla's `chunk_kda(...,
use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5)`.
Packed sequences (`cu_seqlens`): state and conv restart at each boundary. The chunked form (chunk 64, WY
representation with a unit-triangular solve) sits beside the naive recurrence it must equal, fla style.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


CHUNK = 64
L2_EPS = 1e-6


@dataclass(frozen=True)
class KdaTensors:
    """One KDA layer's weights; `conv` is the fused depthwise conv over cat(q, k, v) channels [3C, 1, W]."""

    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    conv: torch.Tensor
    f_a: torch.Tensor
    f_b: torch.Tensor
    g_a: torch.Tensor
    g_b: torch.Tensor
    b_proj: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm: torch.Tensor
    o_proj: torch.Tensor


@dataclass(frozen=True)
class KdaParams:
    """Per-config constants of a KDA layer."""

    heads: int
    head_dim: int
    lower_bound: float
    norm_eps: float


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2 norm: x / sqrt(sum x^2 + eps) (eps inside the sqrt, not a clamp)."""
    import torch

    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each packed sequence."""
    cu = [int(v) for v in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def short_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
               activation: str | None = "silu") -> torch.Tensor:
    """Causal depthwise conv + SiLU per sequence: x [T, C], weight [C, 1, W] -> [T, C] in x.dtype.

    y_t = sum_j w[:, j] * x_(t - W + 1 + j), computed in the weight's dtype (fp32 in the release, as
    transformers' `causal_conv1d_fn`) as plain multiply-adds: no cuDNN, so no TF32 on a GPU.
    """
    import torch
    import torch.nn.functional as F

    w = weight.reshape(weight.shape[0], -1)
    width = w.shape[1]
    out = torch.empty_like(x)
    for s, e in segments(cu_seqlens):
        seg = F.pad(x[s:e].to(w.dtype), (0, 0, width - 1, 0))
        y = torch.zeros_like(seg[:e - s])  # the +0.0 start `sum` had: the same bits, a -0.0 included
        for j in range(width):
            y = y + seg[j:j + e - s] * w[:, j]
        out[s:e] = (F.silu(y) if activation == "silu" else y).to(x.dtype)
    return out


def forget_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, p: KdaParams) -> torch.Tensor:
    """g [T, H, K] = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), fp32 (f = f_b(f_a(x)) [T, H*K])."""
    import torch

    g = (f.float() + dt_bias.float()).view(f.shape[0], p.heads, p.head_dim)
    return p.lower_bound * torch.sigmoid(torch.exp(a_log.float()).view(1, -1, 1) * g)


def _prep(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, l2-normalised, q scaled by K^-0.5."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The naive token-by-token reference. q, k, g [T, H, K]; v [T, H, V]; beta [T, H] -> o [T, H, V] fp32."""
    import torch

    q, k = _prep(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for s, e in segments(cu_seqlens):
        state = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
        for t in range(s, e):
            state = state * g[t].exp().unsqueeze(-1)
            delta = (v[t] - (state * k[t].unsqueeze(-1)).sum(-2)) * beta[t].unsqueeze(-1)
            state = state + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
            out[t] = (state * q[t].unsqueeze(-1)).sum(-2)
    return out


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The chunked form (same contract as `recurrent_kda`): sequential over chunks, parallel inside one."""
    import torch

    q, k = _prep(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for s, e in segments(cu_seqlens):
        state = torch.zeros(v.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
        for c in range(s, e, chunk):
            c_end = min(c + chunk, e)
            qc, kc, vc, gc, bc = (t[c:c_end].transpose(0, 1) for t in (q, k, v, g, beta))
            o, state = _chunk_step(qc, kc, vc, gc, bc, state)
            out[c:c_end] = o.transpose(0, 1)
    return out


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, heads first: q, k, g [H, C, K]; v [H, C, V]; beta [H, C]; state [H, K, V].

    With G the in-chunk cumulative log-decay, the update u of each token solves (I + A) u = beta (v - (k e^G) S0),
    A[t, s] = beta_t sum_c k_t e^(G_t - G_s) k_s (s < t); then o = (q e^G) S0 + (q . e^(G_t - G_s) k_s)_(s<=t) u.
    """
    import torch

    n = q.shape[1]
    big_g = g.cumsum(dim=1)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = (big_g.unsqueeze(2) - big_g.unsqueeze(1)).masked_fill(~causal[..., None], float("-inf"))
    decay = diff.exp()  # [H, t, s, K], zero above the diagonal
    kk = torch.einsum("htc,htsc,hsc->hts", k, decay, k)
    a = beta.unsqueeze(-1) * kk.tril(-1) + torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * (v - (k * big_g.exp()) @ state)
    u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    qk = torch.einsum("htc,htsc,hsc->hts", q, decay, k)
    o = (q * big_g.exp()) @ state + qk @ u
    last = big_g[:, -1:]
    state = state * last.exp().transpose(1, 2) + (k * (last - big_g).exp()).transpose(1, 2) @ u
    return o, state


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(o; weight, eps) * sigmoid(gate), all in fp32 (o, gate [..., K])."""
    import torch

    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * o * torch.sigmoid(gate.float())


def kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
             a_log: torch.Tensor, dt_bias: torch.Tensor, p: KdaParams, cu_seqlens: torch.Tensor,
             chunked: bool = True) -> torch.Tensor:
    """The gated delta rule from raw inputs, fla's fused-kernel contract: o [T, H, V] fp32 from q, k [T, H, K],
    v [T, H, V], the raw gate input f [T, H*K] and beta logits b [T, H] (gate and beta computed here)."""
    import torch

    g = forget_gate(f, a_log, dt_bias, p)
    return (chunk_kda if chunked else recurrent_kda)(q, k, v, g, torch.sigmoid(b), cu_seqlens)


ShortConv = Callable[..., "torch.Tensor"]  # short_conv's contract (glmconv.kernels.kda has the GPU one)
KdaCore = Callable[..., "torch.Tensor"]  # kda_core's contract


def kda_layer(x: torch.Tensor, w: KdaTensors, p: KdaParams, cu_seqlens: torch.Tensor, chunked: bool = True,
              conv: ShortConv = short_conv, core: KdaCore | None = None) -> torch.Tensor:
    """The whole KDA sub-block: x [T, hidden] (already input-normed) -> [T, hidden] in x.dtype.

    `conv` / `core`: the short conv and the gated delta rule to run (the references here; the GPU kernels of
    glmconv.kernels.kda have the same contracts), so the kernel path and the reference share every other line."""
    import torch
    import torch.nn.functional as F

    t, c = x.shape[0], p.heads * p.head_dim
    qkv = torch.cat([F.linear(x, w.q_proj), F.linear(x, w.k_proj), F.linear(x, w.v_proj)], dim=-1)
    q, k, v = (z.reshape(t, p.heads, p.head_dim) for z in torch.split(conv(qkv, w.conv, cu_seqlens), c, dim=-1))
    f = F.linear(F.linear(x, w.f_a), w.f_b)
    run = core if core is not None else partial(kda_core, chunked=chunked)
    o = run(q, k, v, f, F.linear(x, w.b_proj), w.a_log, w.dt_bias, p, cu_seqlens).to(x.dtype)
    gate = F.linear(F.linear(x, w.g_a), w.g_b).view(t, p.heads, p.head_dim)
    o = gated_rms_norm(o, gate, w.o_norm, p.norm_eps).to(x.dtype).reshape(t, c)
    return F.linear(o, w.o_proj)
