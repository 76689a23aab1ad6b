"""KDA on a GPU through fla's `chunk_kda`; reference: `glmconv.ops.kda` (kda_layer, chunk_kda, recurrent_kda).

Same layer as the reference (its very code, `kda_layer` below), with the three hot parts in fla's triton kernels:
the packed q/k/v short conv (`causal_conv1d` with cu_seqlens, SiLU fused), and the gated delta rule with the gate
lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), beta = sigmoid(b) and the q/k l2 norm all computed in
kernel (fp32 state, chunk 64, packed sequences through cu_seqlens). Projections and the gated output norm
stay torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glmconv.ops.kda import KdaParams, KdaTensors
from glmconv.ops.kda import kda_layer as reference_layer

if TYPE_CHECKING:
    import torch


def short_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
               activation: str | None = "silu") -> torch.Tensor:
    """Causal depthwise conv + SiLU of packed sequences: x [T, C], weight [C, 1, W] -> [T, C] in x.dtype."""
    from fla.modules.causal_conv1d import causal_conv1d

    y: torch.Tensor  # fla ships no types
    y, _ = causal_conv1d(x.unsqueeze(0), weight.reshape(weight.shape[0], -1), activation=activation,
                         cu_seqlens=cu_seqlens.long())
    return y.squeeze(0)


def kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
             a_log: torch.Tensor, dt_bias: torch.Tensor, p: KdaParams, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """o [T, H, V] in v.dtype from q, k [T, H, K], v [T, H, V], raw gate input f [T, H*K], beta logits b [T, H].

    The reference equivalent is `chunk_kda(q, k, v, forget_gate(f, ...), sigmoid(b), cu_seqlens)`.
    """
    from fla.ops.kda import chunk_kda

    t, h, d = q.shape
    o: torch.Tensor  # fla ships no types
    o, _ = chunk_kda(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), f.reshape(1, t, h, d), b.unsqueeze(0),
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=True, lower_bound=p.lower_bound, A_log=a_log.float(), dt_bias=dt_bias.float(),
                     cu_seqlens=cu_seqlens.long())
    return o.squeeze(0)


def kda_layer(x: torch.Tensor, w: KdaTensors, p: KdaParams, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The whole KDA sub-block on these kernels: the reference layer's code with its conv and core swapped."""
    return reference_layer(x, w, p, cu_seqlens, conv=short_conv, core=kda_core)
