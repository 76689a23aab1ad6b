"""Tables for RESULTS.md from the reports of benchmarks/gpu_verdict.sh: per run, the verdict and its cost; per
planted defect, whether the verdict named it and how far beyond the run's measured noise it stood.

Usage: python benchmarks/verdict_summary.py DIR...   (each DIR holds NAME/report.json of a run)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _n(v: float | None) -> float:
    """A report number; null (NaN or infinite, its reason in `<field>_why`) as infinity."""
    return float("inf") if v is None else v


def _fd(fd: dict | None) -> str:
    if fd is None:
        return "none"
    return f"layer {fd['layer']} {fd['sub_block']}, {fd.get('cause', 'fixed threshold')}"


def run_rows(reports: dict[str, dict]) -> list[str]:
    out = ["| run | mode, dtype | verdict | max rel err | max x noise | max ref err | top-1 | wall s | peak device |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, r in reports.items():
        recs = r["layers"]
        excess = max(_n(rec.get("excess", 0.0)) for rec in recs)
        ref = max(_n(rec.get("ref_rel_err", 0.0)) for rec in recs)
        peak = r.get("peak_memory", {}).get("bytes", 0) / 1e9
        out.append(f"| {name} | {r['mode']}, {r['dtype']} | {'PASSED' if r['passed'] else 'FAILED'}: "
                   f"{_fd(r['first_divergence'])} | {max(_n(rec['rel_err']) for rec in recs):.3g} | {excess:.3g} | "
                   f"{ref:.3g} | {r['logits']['top1_agreement']:.3f} | {r.get('wall_s', 0):.1f} | {peak:.1f} GB |")
    return out


def defect_rows(reports: dict[str, dict]) -> list[str]:
    runs = [(n, r) for n, r in reports.items() if r.get("self_test")]
    head = "| defect | planted at | " + " | ".join(f"{n}: named, x noise, ref err" for n, _ in runs) + " |"
    out = [head, "|---|---|" + "---|" * len(runs)]
    names = [row["defect"] for row in runs[0][1]["self_test"]]
    for defect in names:
        cells, planted = [], ""
        for _, r in runs:
            row = next((x for x in r["self_test"] if x["defect"] == defect), None)
            if row is None:
                cells.append("-")
                continue
            p = row["planted_at"][0]
            planted = f"layer {p['layer']} {p['sub_block']}"
            fd = row["first_divergence"]
            cells.append("MISSED" if not row["named"] else
                         f"yes, {_n(fd['excess']):.3g}x, {_n(fd['ref_rel_err']):.2e}")
        out.append(f"| {defect} | {planted} | " + " | ".join(cells) + " |")
    return out


def main(dirs: list[str]) -> None:
    reports = {p.parent.name: json.loads(p.read_text()) for d in dirs for p in sorted(Path(d).glob("*/report.json"))}
    print("\n".join(run_rows(reports)))
    print()
    print("\n".join(defect_rows(reports)))


if __name__ == "__main__":
    main(sys.argv[1:])
