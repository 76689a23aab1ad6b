"""The one declaration of parity's metrics and table columns: the `--fail-on` names, the report's `summary`, the
table's columns and the JSON schema (glmconv.compare.schema) are all read from `METRICS` and `COLUMNS`.

A new metric is one `Metric` entry (its name, unit, how it is computed from the judged records and the logit
summary, whether `--fail-on` may bound it, the column it brings, the verdict rule that reads it) plus, where it
needs a new per-sub-block measurement, that field of `SubBlockRecord` (glmconv.compare.records).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from glmconv.compare.cells import field_text, fmt, num
from glmconv.compare.records import SubBlockRecord

Json = dict[str, Any]
Records = Sequence[SubBlockRecord]
Cell = Callable[[Json, Json], str]  # (a record's JSON, the report's JSON) -> the cell's text


def _always(report: Json) -> bool:
    return True


def _noise_measured(report: Json) -> bool:
    return bool(report.get("noise_measured"))


def _kernels_ran(report: Json) -> bool:
    return report.get("kernels") == "kernels"


def _backend_said(report: Json) -> bool:
    """A train backend of more than one implementation says which code ran each sub-block (`impl`)."""
    return bool(report.get("train_impl"))


@dataclass(frozen=True)
class Column:
    """A column of the per-sub-block table (terminal and Markdown)."""

    header: str
    cell: Cell
    left: bool = False  # text, left-justified; numbers are right-justified
    shown: Callable[[Json], bool] = _always  # whether this run's report has it


def number_column(header: str, key: str, spec: str = ".3e", shown: Callable[[Json], bool] = _always) -> Column:
    """A column of one record number."""
    return Column(header, lambda rec, report: field_text(rec, key, spec), shown=shown)


@dataclass(frozen=True)
class Metric:
    """A single number of a run: what `summary` holds and `--fail-on` bounds."""

    name: str
    unit: str
    doc: str
    value: Callable[[Records, Json], float | None]  # (the clean side's judged records, the logit summary)
    record_field: str | None = None  # the record field it is the largest (or last) of: explains a non-finite value
    missing: str = "no sub-block record holds it"  # why a run has no value (None)
    bound: bool = True  # `--fail-on` may bound it
    column: Column | None = None  # a table column of its own, appended after COLUMNS
    rule: str | None = None  # the verdict rule (glmconv.compare.verdict.reasons) that reads the same measurement


def nanmax(xs: Sequence[float]) -> float | None:
    """The largest, NaN if any is (a metric that cannot be computed never passes a gate), None for none."""
    if not xs:
        return None
    return math.nan if any(math.isnan(x) for x in xs) else max(xs)


def _largest(pick: Callable[[SubBlockRecord], float | None]) -> Callable[[Records, Json], float | None]:
    def value(records: Records, logits: Json) -> float | None:
        return nanmax([v for v in map(pick, records) if v is not None])
    return value


def _smallest_overlap(name: str) -> Callable[[Records, Json], float | None]:
    def value(records: Records, logits: Json) -> float | None:
        found = [m.overlap for m in (r.selection(name) for r in records) if m is not None]
        return min(found) if found else None
    return value


def _selection_excess(name: str) -> Callable[[SubBlockRecord], float | None]:
    def pick(rec: SubBlockRecord) -> float | None:
        m = rec.selection(name)
        return None if m is None else m.excess
    return pick


def _divergences(records: Records, logits: Json) -> float:
    return float(sum(bool(r.diverged) for r in records))


def _final(records: Records, logits: Json) -> float | None:
    return records[-1].rel_err if records else None


def _logprob(stat: str) -> Callable[[Records, Json], float | None]:
    def value(records: Records, logits: Json) -> float | None:
        found: float = logits["logprob_abs_diff"][stat]
        return found
    return value


def _kl(records: Records, logits: Json) -> float:
    found: float = logits["kl"]
    return found


def _top1(records: Records, logits: Json) -> float:
    found: float = logits["top1_agreement"]
    return found


def _top1_disagreement(records: Records, logits: Json) -> float:
    return 1.0 - _top1(records, logits)


NO_DSA, NO_MOE = "no DSA layer", "no MoE layer"

# in the order the report's `summary` lists them
METRICS: tuple[Metric, ...] = (
    Metric("excess.max", "x noise", "the largest rel err over its measured noise", _largest(lambda r: r.excess),
           record_field="excess", rule="rel err beyond noise"),
    Metric("ref_rel_err.max", "relative", "the largest difference of weights and conventions alone (fp32 twins)",
           _largest(lambda r: r.ref_rel_err), record_field="ref_rel_err",
           missing="no sub-block ran its fp32 references", rule="reference rel err"),
    Metric("topk_excess.max", "x noise", "the largest top-k disagreement over its measured noise",
           _largest(_selection_excess("topk")), record_field="topk_excess", missing=NO_DSA, rule="topk beyond noise"),
    Metric("expert_excess.max", "x noise", "the largest expert disagreement over its measured noise",
           _largest(_selection_excess("experts")), record_field="experts_excess", missing=NO_MOE,
           rule="experts beyond noise"),
    Metric("divergences", "count", "sub-blocks the verdict names (and differing embedding or head weights)",
           _divergences),
    Metric("logprob_abs_diff.mean", "nats", "mean |log p_train - log p_serve| of the next token", _logprob("mean")),
    Metric("logprob_abs_diff.p99", "nats", "its 99th percentile", _logprob("p99")),
    Metric("logprob_abs_diff.max", "nats", "its largest", _logprob("max")),
    Metric("kl", "nats per token", "mean KL(serve || train) of the next-token distributions", _kl),
    Metric("top1_agreement", "share", "positions whose argmax agrees", _top1),
    Metric("top1_disagreement", "share", "1 - top1_agreement", _top1_disagreement),
    Metric("max_rel_err", "relative", "the largest stream rel err of any sub-block", _largest(lambda r: r.rel_err),
           record_field="rel_err", rule="rel err beyond noise"),
    Metric("final_rel_err", "relative", "the last sub-block's stream rel err", _final, record_field="rel_err"),
    Metric("expert_overlap_min", "share", "the smallest MoE expert overlap", _smallest_overlap("experts"),
           missing=NO_MOE, rule="experts beyond noise"),
    Metric("topk_overlap_min", "share", "the smallest DSA top-k overlap", _smallest_overlap("topk"),
           missing=NO_DSA, rule="topk beyond noise"),
)


def _overlap(rec: Json, report: Json) -> str:
    parts = [f"experts {rec['expert_overlap']:.3f}" if "expert_overlap" in rec else "",
             f"top-k {rec['topk_overlap']:.3f}" if "topk_overlap" in rec else ""]
    return " ".join(p for p in parts if p) or "-"


def _kernel(rec: Json, report: Json) -> str:
    """The check nearest its bound (`chunk_kda 4.6e-03 0.18x`), or `-` for no kernel there."""
    checks = rec.get("kernels")
    if not checks:
        return "-"
    worst = max(checks, key=lambda c: num(c["ratio"]))
    return f"{worst['op']} {fmt(worst[worst['metric']])} {fmt(worst['ratio'], '.2g')}x"


COLUMNS: tuple[Column, ...] = (
    Column("layer", lambda rec, report: str(rec["layer"])),
    Column("sub-block", lambda rec, report: rec["sub_block"], left=True),
    Column("type", lambda rec, report: rec["attn_type"] if rec["sub_block"] == "attention" else rec["mlp_type"],
           left=True),
    number_column("rel err", "rel_err"),
    number_column("noise", "noise", shown=_noise_measured),
    number_column("x noise", "excess", ".3g", shown=_noise_measured),
    number_column("ref err", "ref_rel_err"),
    Column("weights", lambda rec, report: rec.get("weights", "-"), left=True),
    Column("overlap", _overlap, left=True),
    Column("kernel", _kernel, left=True, shown=_kernels_ran),
    Column("code", lambda rec, report: rec.get("impl", "-"), left=True, shown=_backend_said),
)


def bound_names() -> tuple[str, ...]:
    """The metrics `--fail-on` may bound."""
    return tuple(m.name for m in METRICS if m.bound)


def scalars(records: Records, logits: Json) -> dict[str, float | None]:
    """Every metric of the run (None: not measured in this run)."""
    return {m.name: m.value(records, logits) for m in METRICS}


def columns(report: Json) -> list[Column]:
    """The table's columns for this report: COLUMNS, then those the metrics bring."""
    found = [*COLUMNS, *(m.column for m in METRICS if m.column is not None)]
    return [c for c in found if c.shown(report)]


def metric(name: str) -> Metric | None:
    return next((m for m in METRICS if m.name == name), None)
