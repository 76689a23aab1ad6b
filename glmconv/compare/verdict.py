"""The parity verdict: which sub-blocks diverge beyond the noise the run itself measured, and why.

Every record (glmconv.compare.records.SubBlockRecord) carries, beside the train-vs-serve stream error `rel_err`:
  noise        = noise_serve + noise_train + noise_kernel: each side's rounding error against its fp32
                 torch-reference twin, measured on correct code (the serve side; the train side's code on the
                 references in the run dtype), plus the kernels' effect on the streams while every kernel is
                 within its bound. With the same weights and conventions both twins compute the same thing, so by
                 the triangle inequality rel_err <= noise: the error an aligned pair can show.
  kernels      = each kernel call of the sub-block against its reference on the same input, with the bound a
                 correct kernel meets (glmconv.kernels.check, glmconv.kernels.bounds): a kernel beyond its bound
                 is a divergence of cause `kernel`, whatever the streams show.
  ref_rel_err  = the fp32 twins against each other: the train-vs-serve difference of weights and conventions
                 alone, with (on CPU exactly, on a GPU to fp32 order) no numerics in it.
  weights      = whether both sides hold the same weights for the sub-block (glmconv.compare.weight_diff).
A sub-block diverges when its weights differ, when a kernel is beyond its bound, when ref_rel_err exceeds the
floor, or when rel_err exceeds both the floor and MARGIN x noise; selections (DSA top-k, MoE experts) likewise on
the disagreement 1 - overlap. Its cause: weights, then kernel, then the differing switches (conventions), then an
earlier divergence carried (upstream, propagated mode), else numerics: the train code's own, outside the kernels.
With --allow-different-weights (`check_weights` off) differing weights alone name no divergence, but where a
sub-block diverges and its weights differ, they are still its cause.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from glmconv.compare.records import SELECTIONS, FirstDivergence, SelectionMeasure, SubBlockRecord
from glmconv.models.conventions import Conventions, acting_at_sub_block

MARGIN = 2.0  # an aligned pair stays at or under 1 x noise (triangle inequality); a divergence is named above 2 x
STREAM_FLOOR = 1e-5  # the smallest stream rel err ever named (a rounding-sized convention at fp32 stays ~1e-6)
SELECTION_FLOOR = 1e-3  # the smallest selection disagreement ever named (a near-tie flip at the real sizes: ~1e-7)

WEIGHTS, KERNEL, CONVENTIONS, UPSTREAM, NUMERICS = "weights", "kernel", "conventions", "upstream", "numerics"
KERNEL_BEYOND = "kernel beyond its bound"
EQUAL, ROUNDED, DIFFER = "equal", "rounded", "differ"  # a sub-block's weights (glmconv.compare.weight_diff)


@dataclass(frozen=True)
class Floors:
    """What a divergence must exceed."""

    stream: float = STREAM_FLOOR
    selection: float = SELECTION_FLOOR
    margin: float = MARGIN


def excess(value: float, noise: float) -> float:
    """value / noise: inf when only the value is non-zero, 0 when both are (NaN stays NaN)."""
    if noise > 0:
        return value / noise
    return 0.0 if value == 0 else (value if math.isnan(value) else math.inf)


def with_noise(rec: SubBlockRecord) -> SubBlockRecord:
    """The record with its `noise`, `excess` and each selection's excess (disagreement units) set."""
    noise = (rec.noise_serve or 0.0) + (rec.noise_train or 0.0) + (rec.noise_kernel or 0.0)
    sels: dict[str, SelectionMeasure] = {}
    for sel in SELECTIONS:
        m = rec.selection(sel.name)
        if m is not None:
            ratio = excess(1.0 - m.overlap, m.noise or 0.0)
            sels[sel.name] = SelectionMeasure(m.overlap, m.noise, m.ref_overlap, ratio)
    return rec.replace(noise=noise, excess=excess(rec.rel_err, noise), **sels)


def reasons(rec: SubBlockRecord, floors: Floors, check_weights: bool = True) -> list[str]:
    """Why the record diverges ([] when it does not): which checks fire."""
    out = []
    if check_weights and rec.weights == DIFFER:
        out.append("weights differ")
    if rec.failing_kernels():
        out.append(KERNEL_BEYOND)
    if not (rec.ref_rel_err if rec.ref_rel_err is not None else rec.rel_err) <= floors.stream:
        out.append("reference rel err")
    if not rec.rel_err <= max(floors.stream, floors.margin * (rec.noise or 0.0)):
        out.append("rel err beyond noise")
    for sel in SELECTIONS:
        m = rec.selection(sel.name)
        if m is None or rec.replayed == sel.name:  # a replayed selection is not what the train side ran
            continue
        if not 1.0 - (m.ref_overlap if m.ref_overlap is not None else m.overlap) <= floors.selection:
            out.append(f"reference {sel.name}")
        if not 1.0 - m.overlap <= max(floors.selection, floors.margin * (m.noise or 0.0)):
            out.append(f"{sel.name} beyond noise")
    return out


@dataclass
class Judge:
    """Judges records as they are measured (forward order) and keeps the first divergence."""

    floors: Floors = field(default_factory=Floors)
    propagated: bool = True
    check_weights: bool = True
    first: FirstDivergence | None = None
    diverged: int = 0

    def __call__(self, rec: SubBlockRecord, switches: Sequence[str]) -> tuple[SubBlockRecord, bool]:
        """`rec` judged; `switches`: the differing train switches acting at it. True when it is the first."""
        rec = with_noise(rec)
        why = reasons(rec, self.floors, self.check_weights)
        if not why:
            return rec.replace(diverged=False), False
        rec = rec.replace(diverged=True, why=tuple(why), cause=self._cause(rec, switches))
        self.diverged += 1
        if self.first is not None:
            return rec, False
        self.first = FirstDivergence.of(rec, switches)
        return rec, True

    def _cause(self, rec: SubBlockRecord, switches: Sequence[str]) -> str:
        if rec.weights == DIFFER:  # the cause wherever they differ, --allow-different-weights or not
            return WEIGHTS
        if rec.failing_kernels():
            return KERNEL
        if switches:
            return CONVENTIONS
        if self.propagated and self.first is not None:
            return UPSTREAM
        return NUMERICS


def judge_records(records: Sequence[SubBlockRecord], serve: Conventions, train: Conventions,
                  judge: Judge) -> list[SubBlockRecord]:
    """Already measured records (forward order) judged with `judge`: a report built from records alone."""

    return [judge(rec, acting_at_sub_block(serve, train, rec.sub_block, rec.attn_type == "dsa"))[0]
            for rec in records]
