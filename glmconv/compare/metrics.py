"""Parity metrics on captured tensors: stream errors, selection overlaps, next-token log-prob and KL.

Everything is computed in float64 from whatever dtype the models ran in, so the metric itself adds no noise
below the fp32 rounding it is meant to measure. "b" / "serve" is always the reference side.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmconv.compare.metric_table import bound_names
from glmconv.errors import GlmconvError
from glmconv.kernels.check import selection_overlap as selection_overlap  # re-exported: one definition

if TYPE_CHECKING:
    import torch


LOGIT_CHUNK = 512  # rows of [T, V] logits turned into log-probs at once: bounds memory at the real vocab


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are zero, inf when only b is)."""
    import torch

    a64, b64 = a.detach().double(), b.detach().double()
    num = float(torch.linalg.vector_norm(a64 - b64))
    den = float(torch.linalg.vector_norm(b64))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise |a - b|."""
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def next_token_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Positions whose next token belongs to the same packed sequence (every position but each last one)."""
    import torch

    cu = cu_seqlens.detach().cpu().long().tolist()
    return torch.tensor([p for lo, hi in zip(cu, cu[1:]) for p in range(lo, hi - 1)], dtype=torch.int64)


@dataclass
class LogitStats:
    """Per-position logit comparisons, accumulated chunk by chunk."""

    logprob_abs_diff: torch.Tensor  # [P] |logp_train(next) - logp_serve(next)| at next-token positions
    top1_agree: torch.Tensor  # [T] bool: argmax equal
    kl: torch.Tensor  # [T] KL(serve || train) per position

    def summary(self) -> dict[str, Any]:
        return {"logprob_abs_diff": quantile_summary(self.logprob_abs_diff),
                "top1_agreement": float(self.top1_agree.double().mean()) if self.top1_agree.numel() else 1.0,
                "kl": float(self.kl.mean()) if self.kl.numel() else 0.0,
                "positions": int(self.top1_agree.numel()),
                "next_token_positions": int(self.logprob_abs_diff.numel())}


def logit_stats(train: torch.Tensor, serve: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> LogitStats:
    """Compare [T, V] logits: next-token log-prob differences (within each sequence), top-1, KL(serve||train)."""
    import torch

    if train.shape != serve.shape or train.dim() != 2 or train.shape[0] != ids.numel():
        raise ValueError(f"logits {tuple(train.shape)} / {tuple(serve.shape)} do not match {ids.numel()} tokens")
    n = train.shape[0]
    nxt = torch.full((n,), -1, dtype=torch.int64)
    pos = next_token_positions(cu_seqlens)
    ids_cpu = ids.detach().cpu().long()
    nxt[pos] = ids_cpu[pos + 1]
    diffs, agree, kls = [], [], []
    for lo, lt, ls in _chunks(train, serve):
        tgt = nxt[lo:lo + lt.shape[0]].to(lt.device)
        has = tgt >= 0
        g = tgt.clamp(min=0).unsqueeze(-1)
        diffs.append((lt.gather(-1, g) - ls.gather(-1, g)).squeeze(-1)[has].abs().cpu())
        agree.append((lt.argmax(-1) == ls.argmax(-1)).cpu())
        kls.append((ls.exp() * (ls - lt)).sum(-1).clamp(min=0.0).cpu())
    return LogitStats(torch.cat(diffs), torch.cat(agree), torch.cat(kls))


def _chunks(train: torch.Tensor, serve: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    import torch

    for lo in range(0, train.shape[0], LOGIT_CHUNK):
        lt = torch.log_softmax(train[lo:lo + LOGIT_CHUNK].detach().double(), dim=-1)
        ls = torch.log_softmax(serve[lo:lo + LOGIT_CHUNK].detach().double(), dim=-1)
        yield lo, lt, ls


def quantile_summary(x: torch.Tensor) -> dict[str, float]:
    """mean, p99 and max of a 1-D sample (zeros when empty)."""
    import torch

    if x.numel() == 0:
        return {"mean": 0.0, "p99": 0.0, "max": 0.0}
    x64 = x.double()
    return {"mean": float(x64.mean()), "p99": float(torch.quantile(x64, 0.99)), "max": float(x64.max())}


# ---- --fail-on bounds over the declared metrics (glmconv.compare.metric_table) --------------------------------

OPERATORS = (">=", "<=", ">", "<")  # METRIC>VALUE fails above VALUE, >= at or above, < below, <= at or below
_SYNTAX = "expected METRIC>VALUE, METRIC>=VALUE, METRIC<VALUE or METRIC<=VALUE"


@dataclass(frozen=True)
class Bound:
    """`METRIC>VALUE` (broken when the metric is above VALUE), `METRIC>=VALUE` (at or above), `METRIC<VALUE`
    (below) or `METRIC<=VALUE` (at or below): the condition that fails the gate."""

    metric: str
    op: str
    limit: float

    @property
    def text(self) -> str:
        return f"{self.metric}{self.op}{self.limit:g}"

    def broken(self, value: float) -> bool:
        """NaN breaks every bound: a metric that cannot be computed never passes a gate."""
        holds = {">": value <= self.limit, ">=": value < self.limit, "<": value >= self.limit,
                 "<=": value > self.limit}[self.op]
        return not holds


def parse_bound(text: str) -> Bound:
    """Parse one --fail-on; raises GlmconvError naming what is wrong (an operator other than >, >=, < and <=
    is named with the ones accepted)."""

    found = re.search(r"[<>=!]+", text)
    if found is None:
        raise GlmconvError(f"--fail-on {text!r}: {_SYNTAX}")
    op = found.group()
    if op not in OPERATORS:
        raise GlmconvError(f"--fail-on {text!r}: operator {op!r} is not one of {', '.join(sorted(OPERATORS))} "
                           f"({_SYNTAX})")
    metric, value = text[:found.start()].strip(), text[found.end():].strip()
    if re.search(r"[<>=!]", value):
        raise GlmconvError(f"--fail-on {text!r}: one operator only ({_SYNTAX})")
    if metric not in bound_names():
        raise GlmconvError(f"--fail-on {text!r}: unknown metric {metric!r} (choose from {', '.join(bound_names())})")
    try:
        limit = float(value)
    except ValueError:
        raise GlmconvError(f"--fail-on {text!r}: {value!r} is not a number") from None
    if math.isnan(limit):
        raise GlmconvError(f"--fail-on {text!r}: the bound must be a number, not NaN")
    return Bound(metric, op, limit)


@dataclass(frozen=True)
class BoundCheck:
    """A bound with the value the run measured and whether it is broken."""

    bound: Bound
    value: float

    @property
    def broken(self) -> bool:
        return self.bound.broken(self.value)

    def as_json(self) -> dict[str, Any]:
        b = self.bound
        return {"bound": b.text, "metric": b.metric, "op": b.op, "limit": b.limit, "value": self.value,
                "broken": self.broken}


def check_bounds(bounds: Iterable[Bound], values: dict[str, float | None],
                 whys: dict[str, str] | None = None) -> list[BoundCheck]:
    """Each bound with the measured value; a metric this run did not measure is refused, with the reason `whys`
    gives for it (glmconv.compare.report.summary_whys)."""

    out = []
    for b in bounds:
        v = values.get(b.metric)
        if v is None:
            why = (whys or {}).get(b.metric, "not measured in this run: no such layers")
            raise GlmconvError(f"--fail-on {b.text}: {b.metric} was {why}")
        out.append(BoundCheck(b, v))
    return out
