"""Summarise the real-cut4 parity reports (benchmarks/gpu_real_cut4.sh) and estimate the full model's run.

Usage: python3 benchmarks/real_cut4_summary.py OUT_DIR  (reads OUT_DIR/parity-*/report.json; prints Markdown).
The estimate scales each measured sub-block kind (KDA or DSA attention, dense or MoE MLP) by how often the
release's 45-layer schedule has it; peak memory does not grow with depth when layers are streamed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# GLM-5.3-Flash's text schedule: 34 KDA + 11 DSA attention layers; 3 dense + 42 MoE MLPs.
FULL = {("attention", "kda"): 34, ("attention", "dsa"): 11, ("mlp", "dense"): 3, ("mlp", "moe"): 42}


def kind(rec: dict) -> tuple[str, str]:
    return rec["sub_block"], rec["attn_type"] if rec["sub_block"] == "attention" else rec["mlp_type"]


def table(r: dict) -> list[str]:
    rows = ["| layer | sub-block | type | rel err | max abs | expert / top-k overlap | kernel err | wall s | load s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for rec in r["layers"]:
        overlap = rec.get("expert_overlap", rec.get("topk_overlap"))
        kernel = rec.get("kernel_out_rel_err", rec.get("kernel_rel_err"))
        rows.append(f"| {rec['layer']} | {rec['sub_block']} | {kind(rec)[1]} | {rec['rel_err']:.3e} | "
                    f"{rec['max_abs']:.3e} | {'-' if overlap is None else f'{overlap:.4f}'} | "
                    f"{'-' if kernel is None else f'{kernel:.3e}'} | {rec['wall_s']:.2f} | {rec['load_s']:.2f} |")
    return rows


def estimate(r: dict) -> list[str]:
    per: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rec in r["layers"]:
        per.setdefault(kind(rec), []).append((rec["wall_s"], rec["load_s"]))
    lines, wall, load = [], 0.0, 0.0
    for k, n in FULL.items():
        if k not in per:
            lines.append(f"- {k}: not measured")
            continue
        w = sum(x for x, _ in per[k]) / len(per[k])
        ld = sum(y for _, y in per[k]) / len(per[k])
        wall, load = wall + n * w, load + n * ld
        lines.append(f"- {k[0]} {k[1]}: {w:.2f} s per sub-block ({ld:.2f} s of it loading) x {n}")
    head = r["elapsed_s"] - sum(rec["wall_s"] for rec in r["layers"])  # embedding and head, measured once
    wall += head
    lines.append(f"- embedding + head: {head:.2f} s (once)")
    lines.append(f"- **full 45-layer model: ~{wall / 60:.1f} min of forward passes ({load / 60:.1f} min loading "
                 f"weights, {(wall - load) / 60:.1f} min compute and metrics), peak device memory "
                 f"~{r['peak_memory']['bytes'] / 1e9:.1f} GB (one layer at a time: independent of depth)**")
    return lines


def summary(path: Path) -> list[str]:
    r = json.loads((path / "report.json").read_text())
    fd, lg = r["first_divergence"], r["logits"]
    first = "none" if fd is None else f"layer {fd['layer']} {fd['sub_block']} (rel err {fd['value']:.3e})"
    overlaps = [rec[k] for rec in r["layers"] for k in ("expert_overlap",) if k in rec]
    topk = [rec["topk_overlap"] for rec in r["layers"] if "topk_overlap" in rec]
    return [
        f"### {path.name}: train conventions `{r['train_conventions_base']}`, {r['tokens']} tokens in "
        f"{r['sequences']} sequences, {r['dtype']}, kernels {r['kernels']}, stream_layers {r['stream_layers']}",
        f"- first divergence: {first}; max rel err {r['summary']['max_rel_err']:.3e}",
        f"- logprob abs diff mean {lg['logprob_abs_diff']['mean']:.3e} max {lg['logprob_abs_diff']['max']:.3e}; "
        f"top-1 agreement {lg['top1_agreement']:.4f}; KL {lg['kl']:.3e}",
        f"- expert overlap min {min(overlaps, default=float('nan')):.4f}; indexer top-k overlap min "
        f"{min(topk, default=float('nan')):.4f}",
        f"- wall {r['wall_s']:.1f} s (forward passes {r['elapsed_s']:.1f} s); peak memory "
        f"{r['peak_memory']['bytes'] / 1e9:.2f} GB ({r['peak_memory']['what']})",
        "", *table(r), "", "Full-model estimate from these figures:", *estimate(r), ""]


def main(out: str) -> None:
    for path in sorted(Path(out).glob("parity-*/")):
        if (path / "report.json").is_file():
            print("\n".join(summary(path)))
        else:
            print(f"### {path.name}: no report.json")


if __name__ == "__main__":
    main(sys.argv[1])
