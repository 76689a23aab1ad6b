"""MoE routing and the (clamped) SwiGLU, as torch references.

Router: logits = x @ W^T in fp32, s = sigmoid(logits); experts chosen by top-k of s + e_score_correction_bias
(the bias steers selection only; group-limited when n_group > 1, as transformers does); weights = s at the
chosen experts / (sum + 1e-20) * routed_scaling_factor. Output: sum_k weight_k * expert_k(x) + shared(x),
the shared expert unscaled. SwiGLU: silu(min(gate, 10)) * clamp(up, -10, 10) with clamp `10` (serve),
silu(gate) * up with clamp `off` (a naive Megatron port).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmconv.errors import GlmconvError

if TYPE_CHECKING:
    import torch


CLAMPS = ("off", "10")
SWIGLU_LIMIT = 10.0


@dataclass(frozen=True)
class RouterParams:
    """Per-config routing constants."""

    top_k: int
    scaling: float
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True


def swiglu_limit(clamp: str, config_limit: float = SWIGLU_LIMIT) -> float | None:
    """The clamp limit a convention value stands for: None for `off`, else the config's swiglu_limit (10)."""
    if clamp not in CLAMPS:
        raise GlmconvError(f"unknown SwiGLU clamp {clamp!r} (choose from {', '.join(CLAMPS)})")
    return None if clamp == "off" else config_limit


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up, with gate clamped above and up clamped both ways at `limit` when given."""
    import torch.nn.functional as F

    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
        limit: float | None) -> torch.Tensor:
    """down(swiglu(gate(x), up(x)))."""
    import torch.nn.functional as F

    return F.linear(swiglu(F.linear(x, gate_w), F.linear(x, up_w), limit), down_w)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
          p: RouterParams) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, k] fp32, expert ids [T, k]) for x [T, hidden]."""
    scores, ids = _scores_and_choice(x, weight, bias, p)
    return _gates(scores, ids, p), ids


def replay_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, p: RouterParams,
                 replay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing replay as Megatron's RouterReplay does it: -> (weights at the replayed ids [T, k], own choice [T, k]).

    Only the selection is replayed: the gate weights are this router's own scores at `replay`, normalised as usual.
    """
    scores, own = _scores_and_choice(x, weight, bias, p)
    return _gates(scores, replay.to(own.device, own.dtype), p), own


def _scores_and_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       p: RouterParams) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.functional as F

    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + bias.float()
    if p.n_group > 1:
        choice = _group_limit(choice, p)
    return scores, choice.topk(p.top_k, dim=-1, sorted=False).indices


def _gates(scores: torch.Tensor, ids: torch.Tensor, p: RouterParams) -> torch.Tensor:
    w = scores.gather(1, ids)
    if p.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * p.scaling


def _group_limit(choice: torch.Tensor, p: RouterParams) -> torch.Tensor:
    """Keep only the experts of the `topk_group` best groups (group score = sum of its top-2)."""
    import torch

    grouped = choice.view(choice.shape[0], p.n_group, -1)
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(p.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1).bool()
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


Expert = Callable[[int], tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]]


def routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, expert: Expert,
           limit: float | None) -> torch.Tensor:
    """sum_k weights_k * expert_{ids_k}(x), experts visited in ascending id (transformers' order)."""
    import torch

    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        y = mlp(x[tok], *expert(int(e)), limit) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
