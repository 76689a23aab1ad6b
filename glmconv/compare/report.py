"""The parity report: one JSON-able dict, rendered as a rich table, Markdown, and a per-layer error plot."""

from __future__ import annotations

import io
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from glmconv.compare import metric_table, metrics
from glmconv.compare.attribution import attribution_line
from glmconv.compare.capture import Capture, Side
from glmconv.compare.catalog import CATALOG
from glmconv.compare.cells import WHY, field_text, fmt, num
from glmconv.compare.inputs import Batch
from glmconv.compare.options import ParityOptions, judge_of
from glmconv.compare.records import FirstDivergence, SubBlockRecord
from glmconv.compare.verdict import DIFFER, Judge, judge_records
from glmconv.defaults import DEFAULT_TRAIN_CONVENTIONS
from glmconv.io.output import claim_report_dir, replace_file
from glmconv.models.conventions import SELECTION, Sides, acting_at
from glmconv.rules import roles as R
from glmconv.text import count, json_text, printable
from glmconv.version import __version__

JSON_NAME, MD_NAME, PNG_NAME = "report.json", "report.md", "error_per_layer.png"
_PLOT_FLOOR = 1e-12  # log-scale floor for exact zeros (plot_notes says so on the plot and in report.md)
_PLOT_TOP = 1e6  # where a NaN or infinite rel err is drawn


def build_report(cap: Capture, opts: ParityOptions, batch: Batch, conventions: Sides,
                 train_layout: str | None = None, skipped: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """Everything a run measured plus what it was asked: the one structure all renderings read.

    `train_layout`: the Megatron layout the train side was read in (None: not known, e.g. a test double).
    `first_divergence`: the verdict's first divergent sub-block (glmconv.compare.verdict) with its cause;
    `attribution`: the differing switches' measured shares there; `indexer_divergence`: the first DSA layer whose
    top-k differs from serve's (overlap < 1), with what explains it; `passed`: the gate (the verdict, or the
    `--fail-on` bounds when any are given; with `--self-test` every planted defect must be named too);
    `self_test_skipped`: the catalog defects that could not be planted in this run, each with the reason.
    """
    clean = _clean(cap, opts, conventions)
    layers = clean.records
    values = metric_table.scalars(layers, cap.logits)
    first = _first(clean.judge.first, layers, cap, opts)
    values["divergences"] = (values["divergences"] or 0.0) + len(_global_defects(cap, opts))
    records = [r.as_json() for r in layers]
    whys = summary_whys(values, records, cap.noise_measured)
    bounds = metrics.check_bounds(opts.bounds, values, whys)
    self_test = [_self_test_row(side) for side in cap.sides[1:]]
    passed = not any(b.broken for b in bounds) if opts.bounds else first is None
    return finite_numbers({
        "glmconv_version": __version__, "hf_dir": str(opts.hf_dir), "mcore_dir": str(opts.mcore_dir),
        "train_layout": train_layout,
        "mode": opts.mode, "dtype": opts.dtype, "device": opts.device, "tokens": batch.tokens,
        "stream_layers": opts.stream_layers,
        "replay": opts.replay, "replay_source": _replay_source(opts),
        "kernels": _kernels_used(layers), **_impls(layers),
        "sequences": batch.sequences, "seed": opts.seed, "inputs": batch.source,
        "train_conventions_base": opts.train_conventions, "train_convention_overrides": list(opts.overrides),
        "conventions": conventions.as_dict(), "threshold": opts.effective_threshold,
        "margin": clean.judge.floors.margin, "selection_floor": clean.judge.floors.selection,
        "noise_measured": cap.noise_measured, "weights_checked": cap.weights_checked,
        "weight_diffs": cap.weight_diffs + clean.weight_diffs,
        "layers": records, "logits": cap.logits, "summary": values,
        "first_divergence": first.as_json() if first else None,
        "first_divergence_switches": list(first.switches) if first else [],
        "attribution": clean.attribution, "indexer_divergence": _indexer_divergence(layers, conventions, opts),
        "gate": "bounds" if opts.bounds else "verdict", "bounds": [b.as_json() for b in bounds],
        **({"self_test": self_test, "self_test_skipped": skipped or []} if opts.self_test else {}),
        "passed": passed and all(r["named"] for r in self_test), "elapsed_s": round(cap.elapsed_s, 3),
    }, whys, cap.noise_measured)


def _impls(layers: list[SubBlockRecord]) -> dict[str, Any]:
    """`train_impl`: the code that ran the train side's sub-blocks, where a backend says (else nothing)."""
    found = sorted({r.impl for r in layers if r.impl is not None})
    return {"train_impl": found} if found else {}


# ---- numbers JSON can hold: a NaN or infinity is null, with the reason beside it -------------------------------

_RATIOS = {"excess": ("rel err", "rel_err"), "topk_excess": ("top-k disagreement", "topk_overlap"),
           "experts_excess": ("expert disagreement", "expert_overlap")}  # record field -> (what, measured from)
NO_NOISE = ("no noise measured in this run: both sides ran fp32 on the torch references, their own references "
            "(--dtype bf16 or a kernel path measures one; ref_rel_err.max and max_rel_err bound such a run)")


def _finite(x: Any) -> bool:
    return not isinstance(x, float) or math.isfinite(x)


def _ratio_of(rec: dict[str, Any], key: str) -> float | None:
    """What a record's ratio field divides by the noise: its rel err, or a selection's disagreement."""
    what = _RATIOS[key][1]
    if what not in rec:
        value: float | None = rec.get("value") if key == "excess" else None  # a first divergence: its rel err
        return value
    ratio: float = rec[what] if key == "excess" else 1.0 - rec[what]
    return ratio


def value_why(key: str, value: float, rec: dict[str, Any], noise_measured: bool = True) -> str:
    """Why `rec[key]` is not a finite number, in one phrase whose first word says what it is (unbounded, NaN,
    infinite): what report.json writes beside the null."""
    if math.isnan(value):
        return f"NaN: {key.replace('_', ' ')} could not be computed (a side's streams or logits hold a NaN or infinity)"
    if key in _RATIOS:
        of = _ratio_of(rec, key)
        measured = "" if noise_measured else " (no noise measured in this run)"
        return f"unbounded: {_RATIOS[key][0]} {fmt(of)} over a noise of 0{measured}"
    if key in ("rel_err", "value", "ref_rel_err"):
        return "infinite: the serve side's streams are zero here and the train side's are not"
    return f"infinite: {key.replace('_', ' ')} has no finite value"


def summary_whys(values: dict[str, float | None], layers: list[dict[str, Any]],
                 noise_measured: bool) -> dict[str, str]:
    """Why each summary metric that is not a finite number is not: not measured in this run (None), or the first
    record it comes from and that record's reason (`unbounded at layer 0 attention: rel err 6.4e-02 over a noise
    of 0 (...)`). The `--fail-on` of such a metric says the same."""
    out = {}
    for metric, value in values.items():
        declared = metric_table.metric(metric)
        if value is None:
            missing = declared.missing if declared else "no sub-block record holds it"
            out[metric] = f"not measured in this run: {missing}"
        elif not _finite(value):
            key = declared.record_field if declared else None
            rows = layers[-1:] if metric == "final_rel_err" else layers
            rec = next((r for r in rows if key is not None and not _finite(r.get(key))), None)
            if rec is None or key is None:
                out[metric] = value_why(metric, value, {})
                continue
            what, _, why = value_why(key, rec[key], rec, noise_measured).partition(": ")
            advice = f"; {NO_NOISE}" if key in _RATIOS and not noise_measured else ""
            out[metric] = f"{what} at {_site(rec)}: {why.removesuffix(' (no noise measured in this run)')}{advice}"
    return out


def finite_numbers(report: dict[str, Any], whys: dict[str, str], noise_measured: bool) -> dict[str, Any]:
    """The report with every NaN or infinite number null and `<field>_why` beside it (a copy: the capture's
    records are not touched). JSON has no such numbers, and a string in their place breaks a reader's
    comparison (`summary["excess.max"] > 4`); null with its reason says what is there and why.

    Summary metrics and the bounds' values take their reasons from `whys` (`summary_whys`)."""

    def walk(x: Any, field: str | None = None) -> Any:
        if isinstance(x, list | tuple):
            return [walk(v, field) for v in x]
        if not isinstance(x, dict):
            return x
        out: dict[str, Any] = {}
        for k, v in x.items():
            if field == "summary" and (v is None or not _finite(v)) and k in whys:
                out[k], out[k + WHY] = None, whys[k]
            elif field == "bounds" and k == "value" and not _finite(v):
                out[k], out[k + WHY] = None, whys.get(x["metric"], value_why(x["metric"], v, x))
            elif isinstance(v, float) and not math.isfinite(v):
                out[k], out[k + WHY] = None, value_why(k, v, x, noise_measured)
            else:
                out[k] = walk(v, k if isinstance(k, str) else None)
        return out

    finite: dict[str, Any] = walk(report)
    return finite


@dataclass(frozen=True)
class _Clean:
    """What the report reads of the clean side: its judge (first divergence, floors) and its judged records."""

    judge: Judge
    records: list[SubBlockRecord]
    weight_diffs: list[dict[str, Any]] = field(default_factory=list)
    attribution: dict[str, Any] | None = None


def _clean(cap: Capture, opts: ParityOptions, conventions: Sides) -> _Clean:
    """The clean side as capture judged it; a capture of records alone (a test double's, or one read back) is
    judged here as capture would have."""
    if cap.sides:
        side = cap.sides[0]
        return _Clean(side.judge, side.records, side.weight_diffs, side.attribution)
    judge = judge_of(opts)
    return _Clean(judge, judge_records(cap.layers, conventions.serve, conventions.train, judge))


def _global_defects(cap: Capture, opts: ParityOptions) -> list[dict[str, Any]]:
    """Differing embedding or head weights (they have no sub-block record); none with --allow-different-weights."""
    if opts.allow_different_weights:
        return []
    return [d for d in cap.weight_diffs if d["kind"] == DIFFER]


def _first(first: FirstDivergence | None, layers: list[SubBlockRecord], cap: Capture,
           opts: ParityOptions) -> FirstDivergence | None:
    """The verdict's first divergence, the embedding's differing rows first and the head's last."""
    glob = _global_defects(cap, opts)
    embed = [d for d in glob if d["sub_block"] == R.EMBED]
    head = [d for d in glob if d["sub_block"] != R.EMBED]
    for diffs in ([embed] + ([] if first else [head])):
        if diffs:
            return FirstDivergence(None, diffs[0]["sub_block"], "weights", None, "weights", ("weights differ",),
                                   weight_diffs=tuple(diffs))
    if first is not None:
        rec = next(r for r in layers if r.site == (first.layer, first.sub_block))
        first = first.replace(weight_diffs=rec.weight_diffs or ())
        if first.cause == "weights" and opts.allow_different_weights:  # different checkpoints, on purpose
            first = first.replace(different_weights_allowed=True)
    return first


def _self_test_row(side: Side) -> dict[str, Any]:
    """One planted defect: where it went and what the verdict says of it."""

    defect = next(d for d in CATALOG if d.name == side.name)
    sites = sorted(side.sites or ())
    first = side.judge.first
    at = (first.layer, first.sub_block) if first else None
    named = at is not None and (at == sites[0] if defect.kind != "convention" else at in sites)
    if defect.kind == "kernel":  # named as a kernel, and as this kernel
        named = named and first is not None and first.kernel is not None and first.kernel.op == defect.op
    tensors = [d for d in side.weight_diffs if d["kind"] == DIFFER]
    return {"defect": defect.name, "kind": defect.kind, "summary": defect.summary,
            "planted_at": [{"layer": layer, "sub_block": sub} for layer, sub in sites[:1 if defect.kind == "weights"
                                                                                    and len(sites) == 1 else 2]],
            "named": named, "first_divergence": first.as_json() if first else None, "tensors": tensors[:4],
            "attribution": side.attribution}


def _indexer_divergence(layers: list[SubBlockRecord], conventions: Sides,
                        opts: ParityOptions) -> dict[str, Any] | None:
    """The first DSA attention record whose own top-k differs from serve's (overlap < 1), and what explains it:
    differing indexer switches, differing weights, noise, an upstream divergence (propagated only), or numerics."""

    for i, rec in enumerate(layers):
        if rec.topk is None or rec.topk.overlap >= 1.0:
            continue
        switches = acting_at(conventions.serve, conventions.train, SELECTION)
        upstream = next((r for r in layers[:i] if r.diverged), None)
        if switches:
            why = "switches"
        elif rec.weights == DIFFER and not opts.allow_different_weights:
            why = "weights"
        elif not rec.diverged:
            why = "noise"
        elif opts.mode == "propagated" and upstream is not None:
            why = "upstream"
        else:
            why = "numerics"
        return {"layer": rec.layer, "sub_block": rec.sub_block, "metric": "topk_overlap",
                "value": rec.topk.overlap, "noise": rec.topk.noise, "explained_by": why,
                "switches": switches,
                "upstream": None if upstream is None else {"layer": upstream.layer,
                                                           "sub_block": upstream.sub_block}}
    return None


def _replay_source(opts: ParityOptions) -> str | None:
    """Whose selections the train side replayed: the serve side's, a payload file's, or none (no replay)."""
    if opts.replay == "none":
        return None
    return "serve" if opts.replay_file is None else str(opts.replay_file)


_REPLAYED = {"routing": "expert choices", "indexer": "indexer top-k", "both": "expert choices and indexer top-k"}


def replay_line(report: dict[str, Any]) -> list[str]:
    """What --replay did, and that the overlaps are the train side's own selections (the disagreement)."""
    what = report.get("replay", "none")
    if what == "none":
        return []
    source = report.get("replay_source") or "serve"
    whose = "the serve side's" if source == "serve" else f"those of {source}"
    gates = " (gate weights from its own router scores)" if what in ("routing", "both") else ""
    return [f"replay {what}: the train side ran {whose} {_REPLAYED[what]}{gates}; rel errs are the numerics under "
            f"replay, overlaps the train side's own selection vs serve's"]


def _kernels_used(layers: list[SubBlockRecord]) -> str:
    """What the train side ran: `kernels` (each kernel checked against its reference) or `reference`."""
    return "kernels" if any(r.kernels is not None for r in layers) else "reference"


def kernel_text(check: dict[str, Any]) -> str:
    """`fla chunk_kda: rel err 7.0e-01 against its reference on the same input, bound 2.5e-02 (28x)`."""
    metric = check["metric"]
    value = check[metric]
    return (f"{check['kernel']}: {metric.replace('_', ' ')} {fmt(value)} against its reference on the same input, "
            f"bound {fmt(check['bound'][metric])} ({fmt(check['ratio'], '.3g')}x)")


def kernel_line(report: dict[str, Any]) -> list[str]:
    """What the gate checked of the kernels: each kernel's worst call against its bound, or that none ran."""
    if report.get("kernels") != "kernels":
        return ["kernels: none checked (the train side ran the torch references: --kernels reference, or no GPU)"]
    worst: dict[str, dict[str, Any]] = {}
    for rec in report["layers"]:
        for c in rec.get("kernels", ()):
            if c["op"] not in worst or num(c["ratio"]) > num(worst[c["op"]]["ratio"]):
                worst[c["op"]] = {**c, "layer": rec["layer"]}
    parts = [f"{c['kernel']} {fmt(c[c['metric']])} ({fmt(c['ratio'], '.2g')}x its bound, layer {c['layer']})"
             for c in worst.values()]
    beyond = sum(not c["within"] for rec in report["layers"] for c in rec.get("kernels", ()))
    state = f"{count(beyond, 'call')} beyond its bound" if beyond else "every call within its bound"
    return [f"kernels checked against their references on the same input ({state}); worst: " + "; ".join(parts)]


def write_report(report: dict[str, Any], out_dir: str | Path,
                 inputs: dict[str, Path | None] | None = None) -> list[Path]:
    """report.json, report.md and error_per_layer.png in `out_dir` (created, outside `inputs`); the paths.

    Without matplotlib (the `report` extra) the PNG is skipped: `report["report_skipped"]` then says so and how
    to get it, and the Markdown says the same where the plot would be.
    """

    d = Path(out_dir)
    claim_report_dir(d, inputs or {})
    if not have_matplotlib():
        report["report_skipped"] = [f"{PNG_NAME}: {PLOT_HINT}"]
    paths = [d / JSON_NAME, d / MD_NAME]
    replace_file(paths[0], (to_json(report) + "\n").encode())
    replace_file(paths[1], to_markdown(report).encode())
    if "report_skipped" not in report:
        paths.append(d / PNG_NAME)
        replace_file(paths[2], plot(report))
    return paths


PLOT_HINT = "skipped, matplotlib is not installed (pip install matplotlib, or pip install 'glmconv[report]')"


def have_matplotlib() -> bool:
    """Whether the plot can be drawn (matplotlib is an optional extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def to_json(report: dict[str, Any]) -> str:
    """Strict JSON (`glmconv.text.json_text`): NaN and infinities are strings, so any JSON parser reads it."""
    return json_text(report, indent=2)


def divergence_line(report: dict[str, Any]) -> str:
    """The verdict in one line: where the first divergence is, how far beyond noise, and what causes it."""
    fd = report["first_divergence"]
    if fd is None:
        noise = f"{report.get('margin', 2):g} x its measured noise and " if report.get("noise_measured") else ""
        weights = "; weights equal" if report.get("weights_checked") else ""
        return (f"no divergence: every sub-block within {noise}rel err {report['threshold']:g} on the references"
                f"{weights}")
    where = (f"layer {fd['layer']} {fd['sub_block']}" if fd.get("layer") is not None else fd["sub_block"])
    if fd.get("value") is None and not fd.get("value" + WHY):
        return f"first divergence: {where}: {_cause_text(fd)}"
    beyond = (f", {field_text(fd, 'excess', '.3g')}x the noise {fmt(fd['noise'])}" if fd.get("noise") else "")
    return (f"first divergence: {where} (rel err {field_text(fd, 'value')}{beyond}; on the fp32 references "
            f"{field_text(fd, 'ref_rel_err')}): {_cause_text(fd)}")


_CAUSES = {"upstream": "carried from an earlier divergence",
           "numerics": "beyond noise with equal weights and switches and every checked kernel within its bound: the "
                       "train code's own numerics outside the kernels differ"}


def _cause_text(fd: dict[str, Any]) -> str:
    if fd.get("cause") == "weights":
        diffs = fd.get("weight_diffs", [])[:3]
        why = ("the checkpoints hold different weights here (--allow-different-weights)"
               if fd.get("different_weights_allowed") else "a conversion defect")
        return f"weights differ ({why}): " + "; ".join(weight_text(d) for d in diffs)
    if fd.get("cause") == "conventions":
        return "train switches acting there: " + ", ".join(fd.get("switches", []))
    if fd.get("cause") == "kernel" and fd.get("kernel"):
        return "kernel " + kernel_text(fd["kernel"])
    cause: str = _CAUSES.get(fd.get("cause", ""), fd.get("cause", ""))
    return cause


def weight_text(d: dict[str, Any]) -> str:
    """`kda.q_proj: HF model...q_proj.weight, Megatron decoder...q_proj.weight, rows 0-15, max abs diff 0.31`."""
    names = [f"HF {', '.join(d['hf'])}" if d.get("hf") else "", f"Megatron {', '.join(d['megatron'])}"
             if d.get("megatron") else ""]
    where = ", ".join(n for n in names if n)
    rounded = " (BF16 rounding)" if d["kind"] == "rounded" else ""
    return (f"{d['field']}{rounded}: {where}{', ' if where else ''}rows {d['rows']}, {d['elements']} values, "
            f"max abs diff {fmt(d['max_abs_diff'], '.3g')}")


def weight_lines(report: dict[str, Any]) -> list[str]:
    """Whether both sides hold the same weights, and each differing tensor (the first few)."""
    if not report.get("weights_checked"):
        return []
    diffs, rounded = report.get("weight_diffs", []), report.get("serve_rounded_to_bf16", 0)
    note = (f" (the serve side read {count(rounded, 'F32 tensor')} rounded to the BF16 the torch_dist checkpoint "
            "stores: a convert --dtype bf16 pair)" if rounded else "")
    if not diffs:
        return [f"weights: every sub-block's, the embedding's and the head's equal bit for bit{note}"]
    shown = [f"weights differ at {_site(d)}: {weight_text(d)}" for d in diffs[:6]]
    return shown + ([f"... and {len(diffs) - 6} more differing tensors (report.json: weight_diffs)"]
                    if len(diffs) > 6 else [])


def _site(d: dict[str, Any]) -> str:
    return f"layer {d['layer']} {d['sub_block']}" if d.get("layer") is not None else d["sub_block"]


def attribution_lines(report: dict[str, Any]) -> list[str]:
    att = report.get("attribution")
    return [attribution_line(att)] if att else []


def indexer_line(report: dict[str, Any]) -> list[str]:
    """Where the train side's indexer first selects differently from serve's, and what explains it."""
    ix = report.get("indexer_divergence")
    if not ix:
        return []
    noise = f", noise alone {ix['noise']:.3g}" if ix.get("noise") else ""
    head = f"indexer selections first differ at layer {ix['layer']} (top-k overlap {ix['value']:.3f}{noise})"
    up = ix.get("upstream") or {}
    why = {"switches": f": {', '.join(ix['switches'])}",
           "weights": ": this layer's weights differ",
           "noise": ": within the noise this run measured",
           "upstream": f": carried from the divergence at layer {up.get('layer')} {up.get('sub_block')}",
           "numerics": ": beyond noise with equal weights and switches"}[ix["explained_by"]]
    return [head + why]


def layout_text(report: dict[str, Any]) -> str:
    """` (mcore layout)` after the train checkpoint, or nothing when the layout is not known."""
    layout = report.get("train_layout")
    return f" ({layout} layout)" if layout else ""


def logits_lines(report: dict[str, Any]) -> list[str]:
    lg = report["logits"]
    lp = lg["logprob_abs_diff"]
    return [f"next-token logprob abs diff: mean {fmt(lp['mean'])}, p99 {fmt(lp['p99'])}, max {fmt(lp['max'])}",
            f"top-1 agreement: {lg['top1_agreement']:.4f}   KL(serve||train): {fmt(lg['kl'])} per token"]


_HOLDS = {">": "<=", ">=": "<", "<": ">=", "<=": ">"}  # METRIC>VALUE fails on `>`; when it passes, `<=` holds


def bound_lines(report: dict[str, Any]) -> list[str]:
    """`FAILED: kl>1e-06 (measured 2e-05)` (the failing condition, which holds) or, for a bound that passes, the
    condition that holds: `ok: logprob_abs_diff.max <= 0.0001 (measured 0)`."""
    return [f"FAILED: {b['bound']} (measured {measured(b)})" if b["broken"] else
            f"ok: {b['metric']} {_HOLDS[b['op']]} {b['limit']:g} (measured {measured(b)})"
            for b in report["bounds"]]


def measured(bound: dict[str, Any]) -> str:
    """A bound's measured value, or why there is no number (`unbounded at layer 0 attention: ...`)."""
    return bound.get("value" + WHY) or fmt(bound["value"])


def _cells(rec: dict[str, Any], report: dict[str, Any]) -> list[str]:
    return [c.cell(rec, report) for c in metric_table.columns(report)]


def _columns(report: dict[str, Any]) -> list[str]:
    return [c.header for c in metric_table.columns(report)]


def _left(report: dict[str, Any]) -> set[str]:
    """The text columns (left-justified)."""
    return {c.header for c in metric_table.columns(report) if c.left}


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """Everything under the table: logits, the verdict, its cause, the weights, selections, kernels, bounds."""
    return (replay_line(report) + logits_lines(report) + [divergence_line(report)] + attribution_lines(report)
            + indexer_line(report) + weight_lines(report) + kernel_line(report) + bound_lines(report)
            + self_test_lines(report) + [gate_line(report)])


def next_step(report: dict[str, Any]) -> str | None:
    """For a verdict failed on a divergence the train conventions cause: whether the weights are equal (the
    conversion exact), and the flag that compares the conversion alone; None otherwise."""
    fd = report["first_divergence"]
    if report["passed"] or report.get("gate") != "verdict" or fd is None or fd.get("cause") != "conventions":
        return None
    equal = report.get("weights_checked") and not any(d["kind"] == DIFFER for d in report.get("weight_diffs", []))
    weights = "the weights are equal bit for bit (the conversion is exact) and " if equal else ""
    switches = ", ".join(fd.get("switches", []))
    if report.get("train_conventions_base") == DEFAULT_TRAIN_CONVENTIONS:
        return (f"{weights}the cause is the train conventions: by default they imitate a Megatron port ({switches} "
                "act here); rerun with --train-conventions serve to check the conversion alone")
    return (f"{weights}the cause is the --train-convention overrides ({switches} act here); without them, "
            "--train-conventions serve checks the conversion alone")


def gate_note(report: dict[str, Any]) -> str | None:
    """One line when --fail-on bounds replaced the verdict's gate while the verdict names a divergence (and no
    `divergences` bound keeps it); None otherwise."""
    fd = report["first_divergence"]
    if report.get("gate") != "bounds" or fd is None or any(b["metric"] == "divergences" for b in report["bounds"]):
        return None
    return (f"--fail-on replaces the verdict's gate: its first divergence ({_site(fd)}, cause {fd.get('cause')}) "
            "does not fail this run; add --fail-on 'divergences>0' to fail on it too")


def gate_line(report: dict[str, Any]) -> str:
    what = "the --fail-on bounds" if report.get("gate") == "bounds" else "the verdict"
    extra = " and the self-test" if "self_test" in report else ""
    return f"{'PASSED' if report['passed'] else 'FAILED'} ({what}{extra})"


def self_test_lines(report: dict[str, Any]) -> list[str]:
    rows = report.get("self_test")
    if rows is None:
        return []
    named = sum(r["named"] for r in rows)
    out = [f"self-test: {named} of {len(rows)} planted defects named at their layer and sub-block"]
    if report["first_divergence"] is not None:
        out.append("  (the clean pair itself diverges: a defect planted after its first divergence cannot be told "
                   "apart; run the self-test on an aligned pair)")
    for r in rows:
        out.append(f"  {'named ' if r['named'] else 'MISSED'} {r['defect']}: planted at {_planted(r)}; "
                   f"{_found(r['first_divergence'])}")
    skipped = report.get("self_test_skipped") or []
    for why in sorted({r["why"] for r in skipped}):
        names = [r["defect"] for r in skipped if r["why"] == why]
        out.append(f"  not planted: {count(len(names), 'defect')} ({', '.join(names)}): {why}")
    return out


def _planted(r: dict[str, Any]) -> str:
    sites = [f"layer {p['layer']} {p['sub_block']}" for p in r["planted_at"]]
    return ", ".join(sites) + (" (where it acts)" if r["kind"] == "convention" else "")


def _found(fd: dict[str, Any] | None) -> str:
    if fd is None:
        return "no divergence named"
    excess = f", {field_text(fd, 'excess', '.3g')}x noise" if fd.get("noise") else ""
    kernel = f": {kernel_text(fd['kernel'])}" if fd.get("kernel") else ""
    return (f"first divergence layer {fd['layer']} {fd['sub_block']} (rel err {field_text(fd, 'value')}{excess}, "
            f"reference {fmt(fd.get('ref_rel_err'))}, {fd.get('cause')}{kernel})")


FIRST_MARK = " <-"  # after the sub-block of the first divergence, in the terminal table
# left out first to last, to fit a width
DROP_ORDER = ("code", "kernel", "type", "noise", "weights", "overlap", "ref err")
_STACKED = {"type": "{}", "rel err": "rel err {}", "noise": "noise {}", "x noise": "{}x noise", "ref err": "ref err {}",
            "weights": "weights {}", "overlap": "{}", "kernel": "kernel {}"}  # a record as one line of these


def print_table(report: dict[str, Any], console: Console, width: int | None = None) -> None:
    """The per-sub-block table, then the verdict and everything that explains it.

    Laid out for `width` columns (default: the console's): a number is never cut. Columns are left out in
    DROP_ORDER until the table fits (a note says which, and the width that shows them all); narrower than the
    table of the essential columns, each record is one line of its fields, wrapped between them."""

    width = width or console.width
    cols = _columns(report)
    fd = report["first_divergence"]
    rows = []
    for rec in report["layers"]:
        first = fd is not None and (fd.get("layer"), fd["sub_block"]) == (rec["layer"], rec["sub_block"])
        cells = _cells(rec, report)
        cells[1] += FIRST_MARK if first else ""
        rows.append((cells, "bold red" if first else "red" if rec.get("diverged") else None))
    shown = list(cols)
    table = _table(report, cols, shown, rows)
    full = _natural_width(console, table)
    for drop in DROP_ORDER:
        if _natural_width(console, table) <= width:
            break
        if drop in shown:
            shown.remove(drop)
            table = _table(report, cols, shown, rows)
    if _natural_width(console, table) <= width:
        console.print(table)
    else:
        shown = []
        _print_stacked(report, cols, rows, console, width)
    left_out = [c for c in cols if c not in shown]
    if shown and left_out:
        console.print(f"(left out to fit {width} columns: {', '.join(left_out)}; COLUMNS={full} or a terminal that "
                      f"wide shows them; --json and --report-dir's report.md have every field)", markup=False,
                      highlight=False, soft_wrap=True)
    for line in verdict_lines(report):
        bad = line.startswith(("FAILED", "  MISSED", "first divergence", "weights differ"))
        console.print(printable(line), style="bold red" if bad else None, markup=False, highlight=False,
                      soft_wrap=True)


def _title(report: dict[str, Any]) -> str:
    replay = report.get("replay", "none")
    return printable(f"glmconv parity: {report['mode']}, {report['dtype']}, {count(report['tokens'], 'token')} in "
                     f"{count(report['sequences'], 'sequence')}" + ("" if replay == "none" else f", replay {replay}"))


def _table(report: dict[str, Any], cols: list[str], shown: list[str],
           rows: list[tuple[list[str], str | None]]) -> Table:
    t = Table(title=Text(_title(report)))
    for col in shown:
        t.add_column(col, justify="left" if col in _left(report) else "right", no_wrap=True)
    keep = [cols.index(c) for c in shown]
    for cells, style in rows:
        t.add_row(*(cells[i] for i in keep), style=style)
    return t


def _natural_width(console: Console, table: Table) -> int:
    """The columns `table` takes when nothing in it is wrapped or cut."""
    return console.measure(table, options=console.options.update_width(10_000)).maximum


def _print_stacked(report: dict[str, Any], cols: list[str], rows: list[tuple[list[str], str | None]],
                   console: Console, width: int) -> None:
    """The table as lines of fields, a record at a time (`layer 0 attention <-: kda, rel err 6.450e-02, ...`),
    packed into `width` columns and broken only between fields: for a width under the narrowest table."""
    console.print(_title(report), markup=False, highlight=False, soft_wrap=True)
    for cells, style in rows:
        fields = [_STACKED.get(c, c + " {}").format(v) for c, v in zip(cols[2:], cells[2:]) if v != "-"]
        lines = [f"layer {cells[0]} {cells[1]}:"]
        for i, text in enumerate(fields):
            item = text + ("," if i < len(fields) - 1 else "")
            if len(lines[-1]) + 1 + len(item) <= width:
                lines[-1] += f" {item}"
            else:  # a field wider than a line is broken between its words, never inside a number
                lines += [f"  {part}" for part in textwrap.wrap(item, max(width - 2, 1), break_long_words=False,
                                                                  break_on_hyphens=False)]
        for line in lines:
            console.print(printable(line), style=style, markup=False, highlight=False, soft_wrap=True)


def to_markdown(report: dict[str, Any]) -> str:
    """A self-contained Markdown page: settings, conventions, per-layer table, logits, verdict."""
    conv = report["conventions"]
    keys = sorted(set(conv.get("serve", {})) | set(conv.get("train", {})))
    lines = ["# glmconv parity report", "",
             f"- serve: `{report['hf_dir']}`", f"- train: `{report['mcore_dir']}`{layout_text(report)}",
             f"- mode {report['mode']}, dtype {report['dtype']}, device {report['device']}, "
             f"{count(report['tokens'], 'token')} in {count(report['sequences'], 'sequence')}, "
             f"inputs {report['inputs']}, seed {report['seed']}",
             f"- floor (rel err on the references): {report['threshold']:g}; margin over the measured noise: "
             f"{report.get('margin', 2):g}x",
             f"- train side ops: {report.get('kernels', 'reference')}",
             *([f"- train side code: {', '.join(report['train_impl'])}"] if report.get("train_impl") else []),
             f"- {(replay_line(report) or ['replay: none'])[0]}", "",
             "## Conventions", "", "| switch | serve | train |", "|---|---|---|"]
    lines += [f"| {k} | {conv.get('serve', {}).get(k, '-')} | {conv.get('train', {}).get(k, '-')}"
              f"{' (differs)' if conv.get('serve', {}).get(k) != conv.get('train', {}).get(k) else ''} |" for k in keys]
    cols = _columns(report)
    lines += ["", "## Per layer", "", "| " + " | ".join(cols) + " |",
              "|" + "|".join("---" if c in _left(report) else "---:" for c in cols) + "|"]
    lines += ["| " + " | ".join(_cells(rec, report)) + " |" for rec in report["layers"]]
    lines += ["", "## Verdict", ""] + [f"- {s}" for s in verdict_lines(report)]
    if report.get("report_skipped"):
        lines += ["", f"(plot {PLOT_HINT})", ""]
    else:
        lines += ["", f"![relative error per layer]({PNG_NAME})", ""]
        lines += [f"Plot note: {note}." for note in plot_notes(report)] + ([""] if plot_notes(report) else [])
    return "\n".join(lines)


def plot_notes(report: dict[str, Any]) -> list[str]:
    """What the plot draws other than it is: an exact 0 at the log scale's floor, a NaN or infinity at its top."""
    values = [r.get("rel_err") for r in report["layers"]]
    values += [None if r["noise"] is None else 2 * r["noise"] for r in report["layers"]
               if report.get("noise_measured") and "noise" in r]
    notes = []
    if any(v == 0 for v in values):
        notes.append(f"an exact 0 is drawn at {_PLOT_FLOOR:g} (a log scale has no 0)")
    if any(v is None or not math.isfinite(v) for v in values):
        notes.append(f"a NaN or infinite rel err is drawn at {_PLOT_TOP:g}")
    return notes


def plot(report: dict[str, Any]) -> bytes:
    """PNG bytes: log-scale rel err per layer, one series per sub-block, the threshold as a line."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(report)
    try:
        png = io.BytesIO()
        fig.savefig(png, format="png")
        return png.getvalue()
    finally:
        plt.close(fig)


def figure(report: dict[str, Any]) -> Any:
    """The plot's matplotlib figure (close it with `matplotlib.pyplot.close`): what `plot` renders."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        for sub, marker in (("attention", "o"), ("mlp", "s")):
            recs = [r for r in report["layers"] if r["sub_block"] == sub]
            ys = [_plotted(r.get("rel_err")) for r in recs]
            ax.plot([r["layer"] for r in recs], ys, marker=marker, label=sub)
            noise = [_plotted(None if r["noise"] is None else 2 * r["noise"]) for r in recs if "noise" in r]
            if report.get("noise_measured") and len(noise) == len(recs):
                ax.plot([r["layer"] for r in recs], noise, linestyle=":", label=f"{sub}: 2 x measured noise")
        ax.axhline(report["threshold"], color="red", linestyle="--", label=f"floor {report['threshold']:g}")
        _mark_first(ax, report)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("relative error of hc streams (train vs serve)")
        ax.set_title(f"parity: {report['mode']}, {report['dtype']}, {count(report['tokens'], 'token')}")
        ax.grid(True, which="both", alpha=0.3)
        notes = plot_notes(report)
        if notes:  # in the legend, under the series: what a reader would otherwise take for a measured value
            ax.plot([], [], " ", label="\n".join(notes))
        ax.legend(fontsize="small")
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig


def _plotted(v: float | None) -> float:
    """Where a value is drawn on the log scale: an exact 0 at the floor, a NaN or infinity (null) at the top."""
    if v is None or not math.isfinite(v):
        return _PLOT_TOP
    return max(v, _PLOT_FLOOR)


def _mark_first(ax: Any, report: dict[str, Any]) -> None:
    fd = report["first_divergence"]
    if fd is not None and fd.get("layer") is not None and fd.get("value") is not None and math.isfinite(fd["value"]):
        ax.annotate(f"first: {fd['layer']} {fd['sub_block']}", (fd["layer"], _plotted(fd["value"])),
                    textcoords="offset points", xytext=(8, 8), color="red")
