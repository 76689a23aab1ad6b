"""`glmconv verify`: every tensor of an HF checkpoint against its Megatron counterpart, bit for bit, streaming.

Each mapping is checked both ways with the tensors of one step in memory (one mapping, or a window of stacked
experts): the HF tensors, read in the Megatron dtype (FP8 dequantised by the reference formula, as convert does),
run forward through the rule must give the stored Megatron tensors bit for bit, and the stored ones run backward
must give the HF tensors; so a mismatch names the tensor on both sides. A trainer's weight-update check without
the trainer. Both checkpoints are first checked as convert and export check them (plan, shapes, stored args).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.errors import CheckpointError
from glmconv.mistakes import check_pair, check_same_model
from glmconv.plan import Mapping, Plan
from glmconv.rules.table import BF16, F32
from glmconv.runners import convert, export
from glmconv.runners.flow import DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:
    import torch

    from glmconv.io.safetensors.reader import HfTensorSource
    from glmconv.io.torch_dist.reader import DcpReader

LISTED = 100  # mismatches listed in the summary (all are counted)


@dataclass
class VerifyJob:
    """The two checkpoints, each checked against the plan, and the mappings to compare (HF side, Megatron side)."""

    hf: convert.ConvertJob
    mcore: export.ExportJob
    pairs: list[tuple[Mapping, Mapping]]
    left_out: list[str] = field(default_factory=list)  # HF parts the Megatron checkpoint does not hold


@dataclass
class Mismatch:
    """One mapping step whose tensors differ: the names on both sides, how many values and by how much."""

    hf: list[str]
    mcore: list[str]
    rows: tuple[int, int] | None  # the stacked experts compared in this step
    values: int  # Megatron values whose bits differ
    of: int
    max_abs_diff: float

    def as_json(self) -> dict[str, Any]:
        return {"hf": self.hf, "mcore": self.mcore, "rows": list(self.rows) if self.rows else None,
                "values": self.values, "of": self.of, "max_abs_diff": self.max_abs_diff}


def prepare(hf_dir: str | Path, mcore_dir: str | Path) -> VerifyJob:
    """Check both checkpoints (the Megatron one, stored args included, against the HF config) and pair mappings."""
    check_pair("verify", hf_dir, mcore_dir)  # the arguments swapped, or a checkpoint of the wrong kind
    check_same_model(hf_dir, mcore_dir)  # a checkpoint of another model: before its args are read
    mc = export.source_job(mcore_dir, config=hf_dir)
    hf = convert.source_job(hf_dir, layout=mc.plan.layout)  # the pairs meet under the Megatron side's names
    of_hf = hf.plan.mapping_of_mcore
    unpaired = [n for n in mc.plan.mcore_index if n not in of_hf]
    if unpaired:
        raise CheckpointError(f"{unpaired[0]}: in {mc.src} but {hf.src} has no counterpart "
                              f"({len(unpaired)} Megatron tensors have none)")
    pairs = [(m, mc.plan.mapping_of_mcore[m.mcore[0].name]) for m in hf.plan.mappings
             if m.mcore[0].name in mc.plan.mapping_of_mcore]
    left = sorted({m.optional_part(hf.plan.config.num_layers) for m in hf.plan.mappings
                   if m.mcore[0].name not in mc.plan.mapping_of_mcore})
    return VerifyJob(hf=hf, mcore=mc, pairs=pairs, left_out=left)


def verify(job: VerifyJob, *, progress: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
    """Compare every pair; the summary says whether all are equal, with the first and the worst mismatch."""
    from glmconv.io.safetensors.reader import HfTensorSource
    from glmconv.io.torch_dist.reader import DcpReader
    from glmconv.progress import Progress

    start = time.monotonic()
    found: list[Mismatch] = []
    total = sum(mc.mcore_bytes for _, mc in job.pairs)
    with HfTensorSource(job.hf.files) as source, Progress("verify", total, len(job.pairs), enabled=progress) as prog:
        reader = DcpReader(job.mcore.src)
        for hf_m, mc_m in job.pairs:
            found.extend(compare_mapping(hf_m, mc_m, source, reader, job.mcore.stored_rows, chunk_bytes))
            reader.drop_cache()
            prog.advance(mc_m.mcore_bytes)
    return summary(job, found, time.monotonic() - start)


def compare_mapping(hf_m: Mapping, mc_m: Mapping, source: HfTensorSource, reader: DcpReader,
                    stored_rows: dict[str, int], chunk_bytes: int) -> Iterator[Mismatch]:
    """One mapping, step by step (stacked experts a window at a time), both ways."""
    from glmconv.io.dtypes import TORCH_DTYPES

    dtype = TORCH_DTYPES[mc_m.mcore[0].dtype]
    transform = hf_m.rule.transform
    steps = hf_m.row_steps(chunk_bytes)
    if steps is None:
        hf = [source.weight(t.name, dtype) for t in hf_m.hf]
        stored = [reader.read(t.name, (0, t.shape[0]) if t.name in stored_rows else None) for t in mc_m.mcore]
        back = transform.backward(stored, [t.shape for t in hf_m.hf])
        yield from _step(hf_m, range(len(hf_m.hf)), hf, transform.forward(hf, len(stored)), stored, back, None)
        return
    for rows, picks in steps:
        hf = [source.weight(hf_m.hf[i].name, dtype) for i in picks]
        stored = [reader.read(mc_m.mcore[0].name, (rows.start, rows.stop))]
        back = transform.backward(stored, [])
        yield from _step(hf_m, picks, hf, transform.forward(hf, 1), stored, back, (rows.start, rows.stop))


def _step(m: Mapping, picks: range | list[int], hf: list[torch.Tensor], mine: list[torch.Tensor],
          stored: list[torch.Tensor], back: list[torch.Tensor], rows: tuple[int, int] | None) -> Iterator[Mismatch]:
    """Forward against the stored Megatron tensors, backward against the HF ones: a Mismatch when any bit differs."""
    forward = [differ(a, b) for a, b in zip(mine, stored, strict=True)]
    backward = [differ(a, b) for a, b in zip(back, hf, strict=True)]
    if not any(n for n, _ in forward + backward):
        return
    yield Mismatch(hf=[m.hf[i].name for i, (n, _) in zip(picks, backward) if n],
                   mcore=[t.name for t, (n, _) in zip(m.mcore, forward) if n],
                   rows=rows, values=sum(n for n, _ in forward), of=sum(t.numel() for t in stored),
                   max_abs_diff=max(d for _, d in forward + backward))


def differ(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """Values whose bits differ, and the largest absolute difference among them (inf where one is not finite)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel(), 1), float("inf")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    neq = a.contiguous().view(ints) != b.contiguous().view(ints)
    n = int(neq.sum())
    if n == 0:
        return 0, 0.0
    diff = (a[neq].double() - b[neq].double()).abs()
    return n, float(torch.nan_to_num(diff, nan=float("inf")).max())


def dtype_changes(job: VerifyJob) -> dict[str, int]:
    """HF tensors whose Megatron counterpart has another dtype (convert --dtype): compared after the same cast.

    `rounded_f32_to_bf16` counts the stored-F32 tensors that are BF16 in Megatron (`--dtype bf16`: equal here
    means equal after rounding, not to the F32 bits); `widened_bf16_to_f32` those widened (exact)."""
    changes = {"rounded_f32_to_bf16": 0, "widened_bf16_to_f32": 0}
    for hf_m, mc_m in job.pairs:
        to = mc_m.mcore[0].dtype
        for stored in hf_m.stored:
            if (stored, to) == (F32, BF16):
                changes["rounded_f32_to_bf16"] += 1
            elif (stored, to) == (BF16, F32):
                changes["widened_bf16_to_f32"] += 1
    return changes


def summary(job: VerifyJob, found: list[Mismatch], elapsed: float) -> dict[str, Any]:
    """Counts, the first and the worst mismatch, and up to LISTED of them."""
    plan: Plan = job.mcore.plan
    hf_names = sum(len(hf_m.hf) + sum(1 for s in hf_m.scales if s) for hf_m, _ in job.pairs)
    worst = max(found, key=lambda f: f.max_abs_diff, default=None)
    return {"hf": str(job.hf.src), "mcore": str(job.mcore.src), "iteration": job.mcore.iteration,
            "fp8_source": job.hf.plan.fp8, "mtp": plan.mtp, "vision": plan.vision, "layout": plan.layout,
            "left_out": job.left_out, **dtype_changes(job),
            "mappings": len(job.pairs), "hf_tensors": hf_names, "mcore_tensors": len(plan.mcore_index),
            "bytes": sum(mc.mcore_bytes for _, mc in job.pairs), "equal": not found, "mismatches": len(found),
            "first_mismatch": found[0].as_json() if found else None,
            "worst_mismatch": worst.as_json() if worst else None,
            "listed": [f.as_json() for f in found[:LISTED]], "elapsed_s": round(elapsed, 3)}
