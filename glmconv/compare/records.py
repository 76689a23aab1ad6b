"""What parity measures, as frozen typed records: a sub-block's measurements, the verdict on them, the first
divergence. Each record turns into the report's JSON here and nowhere else (`as_json`), and back (`from_json`)
for a report read from disk or a test's records.

Fields that a run did not measure are None and absent from the JSON (an aligned fp32 run on the references has no
`noise_serve`, an MLP no `topk`), so a record says what was measured, not what was assumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glmconv.kernels.check import KernelCheck

Json = dict[str, Any]


@dataclass(frozen=True)
class KernelResult:
    """One kernel call judged against its reference (glmconv.kernels.check.KernelCheck), as the report holds it."""

    op: str  # the op set's field: short_conv, kda_core, indexer, sparse_mla
    kernel: str  # what ran: "fla chunk_kda", ...
    dtype: str
    bound: Mapping[str, float]  # the allowance of each measured quantity
    metric: str  # the quantity that sets the ratio
    ratio: float  # the largest measured / bound
    within: bool
    rel_err: float | None = None
    bias: float | None = None
    mismatch: float | None = None
    overlap: float | None = None

    @classmethod
    def of(cls, check: KernelCheck) -> KernelResult:
        return cls.from_json(check.as_dict())

    @property
    def value(self) -> float | None:
        """The measured quantity that sets the ratio."""
        found: float | None = getattr(self, self.metric)
        return found

    def as_json(self) -> Json:
        out: Json = {"op": self.op, "kernel": self.kernel, "dtype": self.dtype}
        if self.mismatch is not None:
            out.update(mismatch=self.mismatch, overlap=self.overlap)
        else:
            out.update(rel_err=self.rel_err, bias=self.bias)
        return {**out, "bound": dict(self.bound), "metric": self.metric, "ratio": self.ratio, "within": self.within}

    @classmethod
    def from_json(cls, c: Mapping[str, Any]) -> KernelResult:
        return cls(c["op"], c["kernel"], c["dtype"], dict(c["bound"]), c["metric"], c["ratio"], c["within"],
                   c.get("rel_err"), c.get("bias"), c.get("mismatch"), c.get("overlap"))


@dataclass(frozen=True)
class SelectionMeasure:
    """A selection (the DSA top-k or the MoE experts) of the train side against serve's on the same input."""

    overlap: float  # |train ∩ serve| / k, 1.0 when equal
    noise: float | None = None  # the disagreement (1 - overlap) rounding alone makes here: correct code only
    ref_overlap: float | None = None  # the fp32 twins' overlap: conventions and weights alone
    excess: float | None = None  # (1 - overlap) / noise, set by the verdict


@dataclass(frozen=True)
class Selection:
    """How a selection's fields are spelled in the JSON (`topk_overlap`, but `expert_overlap`)."""

    name: str  # the aux key a model returns it under, and the record attribute
    overlap_key: str

    def keys(self) -> tuple[str, str, str, str]:
        """overlap, noise, ref_overlap and excess keys."""
        return (self.overlap_key, f"{self.name}_noise", f"{self.name}_ref_overlap", f"{self.name}_excess")


SELECTIONS = (Selection("topk", "topk_overlap"), Selection("experts", "expert_overlap"))


@dataclass(frozen=True)
class SubBlockRecord:
    """One sub-block of one train side against the serve side: the measurements, then the verdict's fields."""

    layer: int
    sub_block: str  # attention | mlp
    attn_type: str
    mlp_type: str
    rel_err: float  # train vs serve streams, ||t - s|| / ||s||
    max_abs: float
    replayed: str | None = None  # topk | experts: the train side ran serve's selection (not judged)
    kernels: tuple[KernelResult, ...] | None = None  # each kernel call against its reference (kernel path only)
    kernels_within: bool | None = None
    kernel_rel_err: float | None = None  # the kernel path against the train code on the references
    kernel_topk_overlap: float | None = None
    noise_serve: float | None = None  # serve vs its fp32 twin
    noise_train: float | None = None  # the train code on the references vs its fp32 twin
    ref_rel_err: float | None = None  # the fp32 twins against each other: weights and conventions alone
    noise_kernel: float | None = None  # kernel_rel_err while every kernel is within its bound, else 0
    topk: SelectionMeasure | None = None
    experts: SelectionMeasure | None = None
    weights: str | None = None  # equal | rounded | differ (glmconv.compare.weight_diff)
    weight_diffs: tuple[Json, ...] | None = None  # the first few differing tensors, named
    noise: float | None = None  # verdict: noise_serve + noise_train + noise_kernel
    excess: float | None = None  # verdict: rel_err / noise
    diverged: bool | None = None
    why: tuple[str, ...] | None = None  # the checks that fire
    cause: str | None = None  # weights | kernel | conventions | upstream | numerics
    wall_s: float | None = None
    load_s: float | None = None
    impl: str | None = None  # which code ran the train side here, where more than one can

    @property
    def kind(self) -> str:
        """The sub-block's type: the attention's (kda, dsa) or the MLP's (dense, moe)."""
        return self.attn_type if self.sub_block == "attention" else self.mlp_type

    @property
    def site(self) -> tuple[int, str]:
        return self.layer, self.sub_block

    def selection(self, name: str) -> SelectionMeasure | None:
        found: SelectionMeasure | None = getattr(self, name)
        return found

    def failing_kernels(self) -> list[KernelResult]:
        """The kernel checks beyond their bounds."""
        return [c for c in self.kernels or () if not c.within]

    def replace(self, **changes: Any) -> SubBlockRecord:
        return dataclasses.replace(self, **changes)

    def as_json(self) -> Json:
        """The report's form: measured fields only, a selection's fields flat (`topk_overlap`, `topk_noise`)."""
        out: Json = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SELECTION_NAMES:
                out.update(_selection_json(f.name, value, excess=False))
            elif f.name == "excess":
                out["excess"] = value
                for sel in SELECTIONS:
                    out.update(_selection_json(sel.name, self.selection(sel.name), excess=True))
            elif value is not None:
                out[f.name] = _json_value(value)
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> SubBlockRecord:
        """A record from its JSON form (a report read back, or a test's hand-written record)."""
        known = {f.name for f in dataclasses.fields(cls)} - _SELECTION_NAMES - {"kernels"}
        fields: dict[str, Any] = {k: v for k, v in rec.items() if k in known}
        for key in ("why", "weight_diffs"):
            if fields.get(key) is not None:
                fields[key] = tuple(fields[key])
        if rec.get("kernels") is not None:
            fields["kernels"] = tuple(KernelResult.from_json(c) for c in rec["kernels"])
        for sel in SELECTIONS:
            overlap, noise, ref, excess = sel.keys()
            if overlap in rec:
                fields[sel.name] = SelectionMeasure(rec[overlap], rec.get(noise), rec.get(ref), rec.get(excess))
        return cls(**fields)


_SELECTION_NAMES = frozenset(s.name for s in SELECTIONS)


def _selection_json(name: str, m: SelectionMeasure | None, excess: bool) -> Json:
    if m is None:
        return {}
    sel = next(s for s in SELECTIONS if s.name == name)
    overlap, noise, ref, exc = sel.keys()
    if excess:
        return {exc: m.excess}
    return {overlap: m.overlap, noise: m.noise, ref: m.ref_overlap}


def _json_value(value: Any) -> Any:
    if isinstance(value, KernelResult):
        return value.as_json()
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


@dataclass(frozen=True)
class FirstDivergence:
    """The verdict's first divergent sub-block of a side: where, how far beyond noise, why, and its cause."""

    layer: int | None  # None: the embedding or the head (weights only)
    sub_block: str
    metric: str  # rel_err, or weights for the embedding's and head's
    value: float | None
    cause: str
    why: tuple[str, ...]
    switches: tuple[str, ...] = ()
    noise: float | None = None
    excess: float | None = None
    ref_rel_err: float | None = None
    kernel: KernelResult | None = None  # the failing kernel furthest beyond its bound
    weight_diffs: tuple[Json, ...] = ()
    different_weights_allowed: bool = False

    @classmethod
    def of(cls, rec: SubBlockRecord, switches: Sequence[str]) -> FirstDivergence:
        """The first divergence at a judged record."""
        failing = rec.failing_kernels()
        return cls(rec.layer, rec.sub_block, "rel_err", rec.rel_err, rec.cause or "", rec.why or (), tuple(switches),
                   rec.noise, rec.excess, rec.ref_rel_err if rec.ref_rel_err is not None else rec.rel_err,
                   max(failing, key=lambda c: c.ratio) if failing else None)

    def replace(self, **changes: Any) -> FirstDivergence:
        return dataclasses.replace(self, **changes)

    def as_json(self) -> Json:
        """Key order as the report has always written it; the optional parts only where they are set."""
        if self.layer is None:
            out: Json = {"layer": None, "sub_block": self.sub_block, "metric": self.metric, "value": None,
                         "cause": self.cause, "why": list(self.why), "switches": list(self.switches),
                         "weight_diffs": list(self.weight_diffs)}
            return out
        out = {"layer": self.layer, "sub_block": self.sub_block, "metric": self.metric, "value": self.value,
               "noise": self.noise, "excess": self.excess, "ref_rel_err": self.ref_rel_err, "why": list(self.why),
               "cause": self.cause, "switches": list(self.switches)}
        if self.kernel is not None:
            out["kernel"] = self.kernel.as_json()
        if self.weight_diffs:
            out["weight_diffs"] = list(self.weight_diffs)
        if self.different_weights_allowed:
            out["different_weights_allowed"] = True
        return out
