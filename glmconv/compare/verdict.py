"""The parity verdict: which sub-blocks diverge beyond the noise the run itself measured, and why.

Every record carries, beside the train-vs-serve stream error `rel_err`:
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
from dataclasses import dataclass, field
from typing import Any

from glmconv.models.conventions import acting_at_sub_block

MARGIN = 2.0  # an aligned pair stays at or under 1 x noise (triangle inequality); a divergence is named above 2 x
STREAM_FLOOR = 1e-5  # the smallest stream rel err ever named (a rounding-sized convention at fp32 stays ~1e-6)
SELECTION_FLOOR = 1e-3  # the smallest selection disagreement ever named (a near-tie flip at the real sizes: ~1e-7)
SELECTIONS = (("topk", "topk_overlap"), ("experts", "expert_overlap"))

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


def add_noise_fields(rec: dict[str, Any]) -> None:
    """The record's `noise`, `excess` and, per selection, `*_noise` / `*_excess` (disagreement units)."""
    rec["noise"] = rec.get("noise_serve", 0.0) + rec.get("noise_train", 0.0) + rec.get("noise_kernel", 0.0)
    rec["excess"] = excess(rec["rel_err"], rec["noise"])
    for name, key in SELECTIONS:
        if key in rec:
            rec[f"{name}_excess"] = excess(1.0 - rec[key], rec.get(f"{name}_noise", 0.0))


def failing_kernels(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's kernel checks beyond their bounds."""
    return [c for c in rec.get("kernels", ()) if not c["within"]]


def reasons(rec: dict[str, Any], floors: Floors, check_weights: bool = True) -> list[str]:
    """Why the record diverges ([] when it does not): which checks fire."""
    out = []
    if check_weights and rec.get("weights") == DIFFER:
        out.append("weights differ")
    if failing_kernels(rec):
        out.append(KERNEL_BEYOND)
    if not rec.get("ref_rel_err", rec["rel_err"]) <= floors.stream:
        out.append("reference rel err")
    if not rec["rel_err"] <= max(floors.stream, floors.margin * rec.get("noise", 0.0)):
        out.append("rel err beyond noise")
    for name, key in SELECTIONS:
        if key not in rec or rec.get("replayed") == name:  # a replayed selection is not what the train side ran
            continue
        if not 1.0 - rec.get(f"{name}_ref_overlap", rec[key]) <= floors.selection:
            out.append(f"reference {name}")
        if not 1.0 - rec[key] <= max(floors.selection, floors.margin * rec.get(f"{name}_noise", 0.0)):
            out.append(f"{name} beyond noise")
    return out


@dataclass
class Judge:
    """Marks records as they are measured (forward order) and keeps the first divergence."""

    floors: Floors = field(default_factory=Floors)
    propagated: bool = True
    check_weights: bool = True
    first: dict[str, Any] | None = None
    diverged: int = 0

    def __call__(self, rec: dict[str, Any], switches: list[str]) -> bool:
        """Judge `rec`; `switches`: the differing train switches acting at it. True when it is the first."""
        add_noise_fields(rec)
        why = reasons(rec, self.floors, self.check_weights)
        rec["diverged"] = bool(why)
        if not why:
            return False
        rec["why"] = why
        rec["cause"] = self._cause(rec, switches)
        self.diverged += 1
        if self.first is not None:
            return False
        self.first = {"layer": rec["layer"], "sub_block": rec["sub_block"], "metric": "rel_err",
                      "value": rec["rel_err"], "noise": rec["noise"], "excess": rec["excess"],
                      "ref_rel_err": rec.get("ref_rel_err", rec["rel_err"]), "why": why, "cause": rec["cause"],
                      "switches": switches}
        if failing_kernels(rec):
            self.first["kernel"] = max(failing_kernels(rec), key=lambda c: c["ratio"])
        return True

    def _cause(self, rec: dict[str, Any], switches: list[str]) -> str:
        if rec.get("weights") == DIFFER:  # the cause wherever they differ, --allow-different-weights or not
            return WEIGHTS
        if failing_kernels(rec):
            return KERNEL
        if switches:
            return CONVENTIONS
        if self.propagated and self.first is not None:
            return UPSTREAM
        return NUMERICS


def judge_records(records: list[dict[str, Any]], conventions: dict[str, dict[str, str]], judge: Judge) -> Judge:
    """Judge already measured records (forward order) with `judge`: a report built from records alone."""

    serve, train = conventions.get("serve", {}), conventions.get("train", {})
    for rec in records:
        judge(rec, acting_at_sub_block(serve, train, rec["sub_block"], rec.get("attn_type") == "dsa"))
    return judge
