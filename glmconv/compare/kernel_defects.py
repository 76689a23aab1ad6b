"""Kernel-path defects for the self-test: one op of the train side's kernel path given a wrong argument or handing
back a wrong result, its torch reference untouched, the way a wrapper around a real kernel goes wrong.

Each damage takes the op as the kernel path runs it and returns the damaged op (same signature, same output
dtype and shape); the catalog (fixtures/defects.json, kind "kernel") names the op and the damage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


Op = Callable[..., "torch.Tensor"]


def _dt_bias_dropped(op: Op) -> Op:
    """kda_core(q, k, v, f, b, a_log, dt_bias, p, cu_seqlens) with dt_bias = 0."""
    def call(q: Any, k: Any, v: Any, f: Any, b: Any, a_log: Any, dt_bias: Any, *rest: Any, **kw: Any) -> Any:
        return op(q, k, v, f, b, a_log, dt_bias * 0, *rest, **kw)
    return call


def _lower_bound_halved(op: Op) -> Op:
    """kda_core with its KdaParams' gate lower bound halved (fla takes [-5, 0))."""
    def call(q: Any, k: Any, v: Any, f: Any, b: Any, a_log: Any, dt_bias: Any, p: Any, *rest: Any, **kw: Any) -> Any:
        return op(q, k, v, f, b, a_log, dt_bias, dataclasses.replace(p, lower_bound=p.lower_bound / 2), *rest, **kw)
    return call


def _beta_presigmoid(op: Op) -> Op:
    """kda_core handed sigmoid(b) for the beta logits b it applies its own sigmoid to."""
    def call(q: Any, k: Any, v: Any, f: Any, b: Any, *rest: Any, **kw: Any) -> Any:
        return op(q, k, v, f, b.sigmoid(), *rest, **kw)
    return call


def _no_activation(op: Op) -> Op:
    """short_conv without its SiLU."""
    def call(*args: Any, **kw: Any) -> Any:
        return op(*args, **{**kw, "activation": None})
    return call


def _scale_low(op: Op) -> Op:
    """sparse_mla(q, latent, kv_b, topk, v_dim, scale) with scale x 0.75."""
    def call(q: Any, latent: Any, kv_b: Any, topk: Any, v_dim: int, scale: float, **kw: Any) -> Any:
        return op(q, latent, kv_b, topk, v_dim, scale * 0.75, **kw)
    return call


def _ids_plus_one(ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """Every id >= 0 plus one (kept inside the batch, so a kernel reads no memory past it)."""
    import torch

    return torch.where(ids >= 0, (ids + 1).clamp(max=tokens - 1), ids)


def _attend_off_by_one(op: Op) -> Op:
    """sparse_mla handed the selected ids plus one."""
    def call(q: Any, latent: Any, kv_b: Any, topk: Any, *rest: Any, **kw: Any) -> Any:
        return op(q, latent, kv_b, _ids_plus_one(topk, latent.shape[0]), *rest, **kw)
    return call


def _select_off_by_one(op: Op) -> Op:
    """The indexer's ids plus one."""
    def call(x: Any, *rest: Any, **kw: Any) -> Any:
        return _ids_plus_one(op(x, *rest, **kw), x.shape[0])
    return call


def _truncated(op: Op) -> Op:
    """The indexer's rows cut to their first half (the reference's width), -1 after."""
    def call(x: Any, q_resid: Any, w: Any, p: Any, *rest: Any, **kw: Any) -> Any:
        ids = op(x, q_resid, w, p, *rest, **kw).clone()
        ids[:, p.width // 2:] = -1
        return ids
    return call


def _unsorted(op: Op) -> Op:
    """The indexer's rows in token order (-1 last) instead of best first: the same set."""
    def call(*args: Any, **kw: Any) -> Any:
        import torch

        ids = op(*args, **kw)
        top = torch.iinfo(ids.dtype).max
        ordered = torch.where(ids < 0, top, ids).sort(dim=-1).values
        return torch.where(ordered == top, -1, ordered).to(ids.dtype)
    return call


KERNEL_DAMAGES: dict[str, Callable[[Op], Op]] = {
    "dt-bias-dropped": _dt_bias_dropped, "lower-bound-halved": _lower_bound_halved,
    "beta-presigmoid": _beta_presigmoid, "no-activation": _no_activation, "scale-x0.75": _scale_low,
    "ids-off-by-one": _attend_off_by_one, "selected-ids-off-by-one": _select_off_by_one, "truncated": _truncated,
    "unsorted": _unsorted,
}


def damaged(damage: str, op: Op) -> Op:
    """`op` with `damage` planted (the catalog checked the name on load)."""
    return KERNEL_DAMAGES[damage](op)
