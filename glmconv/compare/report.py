"""The parity report: one JSON-able dict, rendered as a rich table, Markdown, and a per-layer error plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import __version__
from glmconv.compare import metrics
from glmconv.text import count, printable

if TYPE_CHECKING:
    from rich.console import Console

    from glmconv.compare import ParityOptions
    from glmconv.compare.capture import Capture
    from glmconv.compare.inputs import Batch

JSON_NAME, MD_NAME, PNG_NAME = "report.json", "report.md", "error_per_layer.png"
_PLOT_FLOOR = 1e-12  # log-scale floor for exact zeros


def build_report(cap: Capture, opts: ParityOptions, batch: Batch, conventions: dict[str, Any],
                 train_layout: str | None = None) -> dict[str, Any]:
    """Everything a run measured plus what it was asked: the one structure all renderings read.

    `train_layout`: the Megatron layout the train side was read in (None: not known, e.g. a test double).
    `first_divergence_switches`: the train switches set differently from serve's that act at the first
    divergence's sub-block (the indexer switches first where its top-k differs); `indexer_divergence`: the first
    DSA layer whose top-k differs from serve's (overlap < 1), with the indexer switches that differ.
    """
    threshold = opts.effective_threshold
    values = metrics.scalars(cap.layers, cap.logits)
    bounds = metrics.check_bounds(opts.bounds, values)
    first = metrics.first_divergence(cap.layers, threshold)
    return {
        "glmconv_version": __version__, "hf_dir": str(opts.hf_dir), "mcore_dir": str(opts.mcore_dir),
        "train_layout": train_layout,
        "mode": opts.mode, "dtype": opts.dtype, "device": opts.device, "tokens": batch.tokens,
        "stream_layers": opts.stream_layers,
        "replay": opts.replay, "replay_source": _replay_source(opts),
        "kernels": _kernels_used(cap, opts),
        "sequences": batch.sequences, "seed": opts.seed, "inputs": batch.source,
        "train_conventions_base": opts.train_conventions, "train_convention_overrides": list(opts.overrides),
        "conventions": conventions, "threshold": threshold, "layers": cap.layers, "logits": cap.logits,
        "summary": values, "first_divergence": first,
        "first_divergence_switches": _switches_at(first, cap.layers, conventions),
        "indexer_divergence": _indexer_divergence(cap.layers, conventions),
        "bounds": bounds, "passed": not any(b["broken"] for b in bounds), "elapsed_s": round(cap.elapsed_s, 3),
    }


def _switches_at(first: dict[str, Any] | None, layers: list[dict[str, Any]],
                 conventions: dict[str, Any]) -> list[str]:
    """`KEY=VALUE` of the differing train switches that act at the first divergence (selection switches first
    where the record's top-k differs from serve's)."""
    from glmconv.models.conventions import SELECTION, acting_at

    if first is None:
        return []
    rec = next(r for r in layers if (r["layer"], r["sub_block"]) == (first["layer"], first["sub_block"]))
    serve, train = conventions.get("serve", {}), conventions.get("train", {})
    sites = [rec["sub_block"]]
    if "topk_overlap" in rec:  # a DSA attention: the indexer switches act there too, first when its top-k differs
        sites = [SELECTION, *sites] if not rec["topk_overlap"] >= 1.0 else [*sites, SELECTION]
    out: list[str] = []
    for site in sites:
        out += [s for s in acting_at(serve, train, site) if s not in out]
    return out


def _indexer_divergence(layers: list[dict[str, Any]], conventions: dict[str, Any]) -> dict[str, Any] | None:
    """The first DSA attention record whose own top-k differs from serve's (overlap < 1), with the differing
    indexer switches; None when every DSA layer selected what serve did."""
    from glmconv.models.conventions import SELECTION, acting_at

    for rec in layers:
        if "topk_overlap" in rec and not rec["topk_overlap"] >= 1.0:
            return {"layer": rec["layer"], "sub_block": rec["sub_block"], "metric": "topk_overlap",
                    "value": rec["topk_overlap"],
                    "switches": acting_at(conventions.get("serve", {}), conventions.get("train", {}), SELECTION)}
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


def _kernels_used(cap: Capture, opts: ParityOptions) -> str:
    """What the train side ran: `kernels` (with kernel error rows) or `reference`."""
    return "kernels" if any("kernel_rel_err" in r for r in cap.layers) else "reference"


def _kernel(rec: dict[str, Any]) -> str:
    """The kernel-error cell: the sub-block output's rel err (kernels vs references), kpool top-k overlap."""
    if "kernel_rel_err" not in rec:
        return "-"
    err = rec.get("kernel_out_rel_err", rec["kernel_rel_err"])
    top = f" top-k {rec['kernel_topk_overlap']:.3f}" if "kernel_topk_overlap" in rec else ""
    return f"{_fmt(err)}{top}"


def kernel_line(report: dict[str, Any]) -> list[str]:
    """One line on the kernels' own error, when the train side ran them."""
    recs = [r for r in report["layers"] if "kernel_rel_err" in r]
    if not recs:
        return []
    worst = max(recs, key=lambda r: r.get("kernel_out_rel_err", r["kernel_rel_err"]))
    return [f"train side ran GPU kernels: the largest kernel error (kernels vs torch references, same input) is "
            f"{_fmt(worst.get('kernel_out_rel_err', worst['kernel_rel_err']))} at layer {worst['layer']} "
            f"{worst['attn_type']} (streams {_fmt(worst['kernel_rel_err'])})"]


def write_report(report: dict[str, Any], out_dir: str | Path,
                 inputs: dict[str, Path | None] | None = None) -> list[Path]:
    """report.json, report.md and error_per_layer.png in `out_dir` (created, outside `inputs`); the paths.

    Without matplotlib (the `report` extra) the PNG is skipped: `report["report_skipped"]` then says so and how
    to get it, and the Markdown says the same where the plot would be.
    """
    from glmconv.output import claim_report_dir, replace_file

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
    """Strict JSON: NaN and infinities become strings, so any JSON parser reads the report."""
    return json.dumps(_finite(report), indent=2)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _fmt(v: Any, spec: str = ".3e") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _overlap(rec: dict[str, Any]) -> str:
    parts = [f"experts {rec['expert_overlap']:.3f}" if "expert_overlap" in rec else "",
             f"top-k {rec['topk_overlap']:.3f}" if "topk_overlap" in rec else ""]
    return " ".join(p for p in parts if p) or "-"


def divergence_line(report: dict[str, Any]) -> str:
    fd = report["first_divergence"]
    if fd is None:
        return f"no sub-block exceeds rel_err {report['threshold']:g}"
    switches = report.get("first_divergence_switches") or []
    there = f"; train switches acting there: {', '.join(switches)}" if switches else ""
    return (f"first divergence: layer {fd['layer']} {fd['sub_block']} (rel_err {_fmt(fd['value'])} > "
            f"{report['threshold']:g}){there}")


def indexer_line(report: dict[str, Any]) -> list[str]:
    """Where the train side's indexer first selects differently from serve's, and the switches that do it."""
    ix = report.get("indexer_divergence")
    if not ix:
        return []
    why = f": {', '.join(ix['switches'])}" if ix.get("switches") else " (no indexer switch differs: upstream error)"
    return [f"indexer selections first differ at layer {ix['layer']} (top-k overlap {ix['value']:.3f}){why}"]


def layout_text(report: dict[str, Any]) -> str:
    """` (mcore layout)` after the train checkpoint, or nothing when the layout is not known."""
    layout = report.get("train_layout")
    return f" ({layout} layout)" if layout else ""


def logits_lines(report: dict[str, Any]) -> list[str]:
    lg = report["logits"]
    lp = lg["logprob_abs_diff"]
    return [f"next-token logprob abs diff: mean {_fmt(lp['mean'])}, p99 {_fmt(lp['p99'])}, max {_fmt(lp['max'])}",
            f"top-1 agreement: {lg['top1_agreement']:.4f}   KL(serve||train): {_fmt(lg['kl'])} per token"]


_HOLDS = {">": "<=", "<": ">="}  # a bound METRIC>VALUE fails on `>`; when it passes, `<=` holds


def bound_lines(report: dict[str, Any]) -> list[str]:
    """`FAILED: kl>1e-06 (measured 2e-05)` (the failing condition, which holds) or, for a bound that passes, the
    condition that holds: `ok: logprob_abs_diff.max <= 0.0001 (measured 0)`."""
    return [f"FAILED: {b['bound']} (measured {_fmt(b['value'])})" if b["broken"] else
            f"ok: {b['metric']} {_HOLDS[b['op']]} {b['limit']:g} (measured {_fmt(b['value'])})"
            for b in report["bounds"]]


def print_table(report: dict[str, Any], console: Console) -> None:
    """The per-sub-block table, the logit metrics, the first divergence and the bounds."""
    from rich.table import Table
    from rich.text import Text

    replay = report.get("replay", "none")
    t = Table(title=Text(printable(f"glmconv parity: {report['mode']}, {report['dtype']}, "
                                   f"{count(report['tokens'], 'token')} in {count(report['sequences'], 'sequence')}"
                                   + ("" if replay == "none" else f", replay {replay}"))))
    cols = ["layer", "sub-block", "type", "rel err", "max abs", "overlap"]
    kernels = report.get("kernels") == "kernels"
    if kernels:
        cols.append("kernel err")
    for col in cols:
        t.add_column(col, justify="right" if col in ("layer", "rel err", "max abs") else "left")
    fd = report["first_divergence"]
    for rec in report["layers"]:
        over = not rec["rel_err"] <= report["threshold"]
        first = fd is not None and (fd["layer"], fd["sub_block"]) == (rec["layer"], rec["sub_block"])
        kind = rec["attn_type"] if rec["sub_block"] == "attention" else rec["mlp_type"]
        cells = [str(rec["layer"]), rec["sub_block"] + (" <- first" if first else ""), kind, _fmt(rec["rel_err"]),
                 _fmt(rec["max_abs"]), _overlap(rec)] + ([_kernel(rec)] if kernels else [])
        t.add_row(*cells, style="bold red" if first else "red" if over else None)
    console.print(t)
    for line in (replay_line(report) + logits_lines(report) + [divergence_line(report)] + indexer_line(report)
                 + kernel_line(report)):
        console.print(printable(line), markup=False, highlight=False, soft_wrap=True)
    for line, b in zip(bound_lines(report), report["bounds"]):
        console.print(printable(line), style="bold red" if b["broken"] else "green", markup=False, highlight=False,
                      soft_wrap=True)


def to_markdown(report: dict[str, Any]) -> str:
    """A self-contained Markdown page: settings, conventions, per-layer table, logits, verdict."""
    conv = report["conventions"]
    keys = sorted(set(conv.get("serve", {})) | set(conv.get("train", {})))
    lines = ["# glmconv parity report", "",
             f"- serve: `{report['hf_dir']}`", f"- train: `{report['mcore_dir']}`{layout_text(report)}",
             f"- mode {report['mode']}, dtype {report['dtype']}, device {report['device']}, "
             f"{count(report['tokens'], 'token')} in {count(report['sequences'], 'sequence')}, "
             f"inputs {report['inputs']}, seed {report['seed']}",
             f"- threshold (rel err): {report['threshold']:g}",
             f"- train side ops: {report.get('kernels', 'reference')}",
             f"- {(replay_line(report) or ['replay: none'])[0]}", "",
             "## Conventions", "", "| switch | serve | train |", "|---|---|---|"]
    lines += [f"| {k} | {conv.get('serve', {}).get(k, '-')} | {conv.get('train', {}).get(k, '-')}"
              f"{' (differs)' if conv.get('serve', {}).get(k) != conv.get('train', {}).get(k) else ''} |" for k in keys]
    kernels = report.get("kernels") == "kernels"
    lines += ["", "## Per layer", "", "| layer | sub-block | type | rel err | max abs | overlap |"
              + (" kernel err |" if kernels else ""), "|---:|---|---|---:|---:|---|" + ("---|" if kernels else "")]
    for rec in report["layers"]:
        kind = rec["attn_type"] if rec["sub_block"] == "attention" else rec["mlp_type"]
        lines.append(f"| {rec['layer']} | {rec['sub_block']} | {kind} | {_fmt(rec['rel_err'])} | "
                     f"{_fmt(rec['max_abs'])} | {_overlap(rec)} |" + (f" {_kernel(rec)} |" if kernels else ""))
    lines += ["", "## Logits", ""] + [f"- {s}" for s in logits_lines(report) + kernel_line(report)]
    lines += ["", "## Verdict", "", f"- {divergence_line(report)}"] + [f"- {s}" for s in indexer_line(report)]
    lines += [f"- {s}" for s in bound_lines(report)]
    if report.get("report_skipped"):
        lines += ["", f"(plot {PLOT_HINT})", ""]
    else:
        lines += ["", f"![relative error per layer]({PNG_NAME})", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any]) -> bytes:
    """PNG bytes: log-scale rel err per layer, one series per sub-block, the threshold as a line."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        for sub, marker in (("attention", "o"), ("mlp", "s")):
            recs = [r for r in report["layers"] if r["sub_block"] == sub]
            ys = [max(r["rel_err"], _PLOT_FLOOR) if math.isfinite(r["rel_err"]) else 1e6 for r in recs]
            ax.plot([r["layer"] for r in recs], ys, marker=marker, label=sub)
        ax.axhline(report["threshold"], color="red", linestyle="--", label=f"threshold {report['threshold']:g}")
        _mark_first(ax, report)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("relative error of hc streams (train vs serve)")
        ax.set_title(f"parity: {report['mode']}, {report['dtype']}, {count(report['tokens'], 'token')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
        return png.getvalue()
    finally:
        plt.close(fig)


def _mark_first(ax: Any, report: dict[str, Any]) -> None:
    fd = report["first_divergence"]
    if fd is not None and math.isfinite(fd["value"]):
        ax.annotate(f"first: {fd['layer']} {fd['sub_block']}", (fd["layer"], fd["value"]),
                    textcoords="offset points", xytext=(8, 8), color="red")
