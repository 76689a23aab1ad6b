"""Each kernel judged against its torch reference on the very input the train side gave it.

`checked(kernels, references, sink)` wraps every op of a kernel op set: the kernel runs and its output goes on
through the model; its reference runs on the same arguments, and `sink` receives a `KernelCheck`. The error of a
correct kernel is then bounded on its own (glmconv.kernels.bounds), never folded into a noise floor it could raise.
Tensors: the relative error and the bias (the error's component along the reference: a scale that rounding does
not make). Selections: the share of ids that differ where the reference scores do not tie (a near-tie flip is
rounding; an id off by one, a truncated or reordered row is not).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmconv.kernels import OpSet
from glmconv.kernels.bounds import BIAS_Z, TIE_RTOL, Bound, bound
from glmconv.ops.kpool import selection_scores

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KernelCheck:
    """One kernel call against its reference: what it measured, the bound a correct kernel meets, the ratio."""

    op: str  # the op set's field: short_conv, kda_core, indexer, sparse_mla
    kernel: str  # what ran: "fla chunk_kda", ...
    dtype: str  # the run dtype the bound is for
    bound: Bound
    rel_err: float | None = None  # tensor ops
    bias: float | None = None  # the error's systematic part (tensor_error)
    tokens: int = 1  # rows the bias was fitted over
    mismatch: float | None = None  # selections
    overlap: float | None = None  # selections: the set overlap, for the reader

    @property
    def bias_bound(self) -> float:
        """The bias a correct kernel may show: the calibrated floor, or what rounding of this call's own error
        leaves systematic by chance (BIAS_Z x its sqrt(2 / T) share), whichever is larger."""
        spread = BIAS_Z * (self.rel_err or 0.0) * math.sqrt(2.0 / max(self.tokens, 1))
        return max(self.bound.bias, spread if math.isfinite(spread) else 0.0)

    def _ratios(self) -> dict[str, float]:
        pairs = {"rel_err": (self.rel_err, self.bound.rel_err), "bias": (self.bias, self.bias_bound),
                 "mismatch": (self.mismatch, self.bound.mismatch)}
        return {k: _ratio(v, b) for k, (v, b) in pairs.items() if v is not None}

    @property
    def ratio(self) -> float:
        """The largest measured / bound (NaN counts as out of bounds)."""
        return max(self._ratios().values(), default=0.0)

    @property
    def within(self) -> bool:
        return self.ratio <= 1.0

    @property
    def metric(self) -> str:
        """The measured quantity that sets the ratio."""
        ratios = self._ratios()
        return max(ratios, key=lambda k: ratios[k]) if ratios else "rel_err"

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (the report's `kernels` entries)."""
        out: dict[str, Any] = {"op": self.op, "kernel": self.kernel, "dtype": self.dtype}
        if self.mismatch is not None:
            out.update(mismatch=self.mismatch, overlap=self.overlap, bound={"mismatch": self.bound.mismatch})
        else:
            out.update(rel_err=self.rel_err, bias=self.bias,
                       bound={"rel_err": self.bound.rel_err, "bias": self.bias_bound})
        return {**out, "metric": self.metric, "ratio": self.ratio, "within": self.within}


def _ratio(value: float, limit: float) -> float:
    if math.isnan(value):
        return math.inf
    return value / limit if limit > 0 else (0.0 if value == 0 else math.inf)


Sink = Callable[[KernelCheck], None]


def checked(kernels: OpSet, references: OpSet, sink: Sink) -> OpSet:
    """`kernels` with each op also run as its reference on the same arguments, the comparison sent to `sink`."""
    wrapped: dict[str, Any] = {op: _checked(op, getattr(kernels, op), getattr(references, op), kernels.kernel_name(op),
                                            sink) for op in OpSet.OPS}
    return OpSet(kernels.name, kernel_names=kernels.kernel_names, **wrapped)


def _checked(op: str, kernel: Callable[..., Any], reference: Callable[..., Any], name: str,
             sink: Sink) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = kernel(*args, **kwargs)
        want = reference(*args, **kwargs)
        dtype = "fp32" if str(args[0].dtype) == "torch.float32" else "bf16"
        if op == "indexer":
            got_scores, want_scores = selection_scores(*args, out, want, **kwargs)
            mismatch, overlap = selection_mismatch(out, want, got_scores, want_scores, args[3].kpool)
            sink(KernelCheck(op, name, dtype, bound(op, dtype), mismatch=mismatch, overlap=overlap))
        else:
            err, bias = tensor_error(out, want)
            sink(KernelCheck(op, name, dtype, bound(op, dtype), rel_err=err, bias=bias, tokens=out.shape[0]))
        return out

    return call


def tensor_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(||got - want|| / ||want||, ||systematic part of the error|| / ||want||), in float64.

    The systematic part is the least-squares fit of the error, per channel (every dim but the first, tokens), by an
    offset plus a gain on the reference: a dropped bias, a wrong scale or gate. Rounding error spread over T tokens
    leaves about sqrt(2 / T) of itself there."""
    import torch

    if got.shape != want.shape:
        return math.inf, math.inf
    w = want.detach().double().reshape(want.shape[0], -1)
    e = got.detach().double().reshape(w.shape) - w
    den = float(torch.linalg.vector_norm(w))
    if den == 0.0:
        return (0.0, 0.0) if float(torch.linalg.vector_norm(e)) == 0.0 else (math.inf, math.inf)
    tokens = w.shape[0]
    e_mean, w_c = e.mean(0), w - w.mean(0)
    gain = (e - e_mean).mul(w_c).sum(0)
    var = w_c.pow(2).sum(0)
    fit = tokens * e_mean.pow(2) + torch.where(var > 0, gain.pow(2) / var.clamp(min=1e-300), torch.zeros_like(var))
    return float(torch.linalg.vector_norm(e)) / den, math.sqrt(float(fit.sum())) / den


def selection_mismatch(got: torch.Tensor, want: torch.Tensor, got_scores: torch.Tensor, want_scores: torch.Tensor,
                       kpool: int, rtol: float = TIE_RTOL) -> tuple[float, float]:
    """(share of selected ids that differ beyond a score tie, set overlap); `got` may be wider (-1 padded).

    Ids at the same place differ by rounding alone when both lie in pools the query sees, at the same offset in
    their pools, and their pools' reference scores tie within `rtol` x the row's largest score."""
    import torch

    width = want.shape[1]
    g, w = got[:, :width].long(), want.long()
    extra = int((got[:, width:] >= 0).sum()) if got.shape[1] > width else 0
    gs, ws = got_scores[:, :width], want_scores
    scale = torch.where(ws.isfinite(), ws.abs(), torch.zeros_like(ws)).amax(-1, keepdim=True)
    tie = ((g - w) % kpool == 0) & gs.isfinite() & ws.isfinite() & ((gs - ws).abs() <= rtol * scale)
    bad = int(((g != w) & ~tie).sum()) + extra
    selected = int(((g >= 0) | (w >= 0)).sum()) + extra
    return (bad / selected if selected else 0.0), selection_overlap(got, want)


def selection_overlap(train: torch.Tensor, serve: torch.Tensor) -> float:
    """Mean over tokens of |T_train & T_serve| / |T_serve|, ignoring -1 sentinels on both sides.

    Rows [T, W] of distinct ids (expert ids or indexer top-k token ids); tokens whose serve row is all -1
    are left out, and a batch with nothing selected counts as full agreement. Sort + searchsorted keeps it
    O(T W log W), not O(T W^2), at the real width (2051).
    """
    import torch

    if train.shape[0] != serve.shape[0]:
        raise ValueError(f"selection rows differ: {tuple(train.shape)} vs {tuple(serve.shape)}")
    s = serve.detach().long().sort(dim=-1).values
    t = train.detach().long()
    pos = torch.searchsorted(s, t).clamp(max=max(s.shape[-1] - 1, 0))
    hit = (s.gather(-1, pos) == t) & (t >= 0) if s.shape[-1] else torch.zeros_like(t, dtype=torch.bool)
    size = (s >= 0).sum(-1)
    keep = size > 0
    if not bool(keep.any()):
        return 1.0
    return float((hit.sum(-1)[keep].double() / size[keep].double()).mean())
