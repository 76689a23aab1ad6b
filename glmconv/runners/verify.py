"""`glmconv verify`: every tensor of an HF checkpoint against its Megatron counterpart, bit for bit, streaming.

Each mapping is checked both ways with the tensors of one step in memory (one mapping, or a window of stacked
experts): the HF tensors, read in the Megatron dtype (FP8 dequantised by the reference formula, as convert does),
run forward through the rule must give the stored Megatron tensors bit for bit, and the stored ones run backward
must give the HF tensors; so a mismatch names the tensor on both sides. A rule that is an exact inverse (bytes only
move) is checked backward alone, on views: equal there proves the forward direction too. A trainer's weight-update
check without the trainer. Both checkpoints are first checked as convert and export check them (plan, shapes,
stored args).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import phases
from glmconv.ahead import Step, run_ahead
from glmconv.defaults import DEFAULT_CHUNK_BYTES, DEFAULT_DEVICE, DEFAULT_THREADS, DEFAULT_WORKERS
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io.dtypes import torch_dtype
from glmconv.io.jsonfile import JsonObject
from glmconv.io.safetensors.reader import HfTensorSource
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.mistakes import check_pair, check_same_model
from glmconv.numerics.dequant import require_device, share_dequantizer
from glmconv.plan import Mapping, Plan
from glmconv.progress import Progress, workers_bar
from glmconv.rules.table import BF16, F32
from glmconv.runners import convert, export_job
from glmconv.runners.backward import ThreadReaders
from glmconv.runners.flow import shares
from glmconv.runners.ranks import Group, gather, progress, progress_here, rank_label, run_ranks, try_
from glmconv.runners.workers import capped

if TYPE_CHECKING:
    import torch

    # one step's outcome: (pair index, Megatron bytes compared, whether it ends the pair, its mismatches)
    Compared = tuple[int, int, bool, list["Mismatch"]]

LISTED = 100  # mismatches listed in the summary (all are counted)


@dataclass
class VerifyJob:
    """The two checkpoints, each checked against the plan, and the mappings to compare (HF side, Megatron side)."""

    hf: convert.ConvertJob
    mcore: export_job.ExportJob
    pairs: list[tuple[Mapping, Mapping]]
    left_out: list[str] = field(default_factory=list)  # HF parts the Megatron checkpoint does not hold
    config_keys_ignored: list[str] = field(default_factory=list)  # differ, but change neither model nor numerics


@dataclass
class Mismatch:
    """One mapping step whose tensors differ: the names on both sides, how many values and by how much."""

    hf: list[str]
    mcore: list[str]
    rows: tuple[int, int] | None  # the stacked experts compared in this step
    values: int  # Megatron values whose bits differ
    of: int
    max_abs_diff: float

    def as_json(self) -> JsonObject:
        return {"hf": self.hf, "mcore": self.mcore, "rows": list(self.rows) if self.rows else None,
                "values": self.values, "of": self.of, "max_abs_diff": self.max_abs_diff}


def prepare(hf_dir: str | Path, mcore_dir: str | Path) -> VerifyJob:
    """Check both checkpoints (the Megatron one, stored args included, against the HF config) and pair mappings."""
    phases.begin()
    phases.import_torch()  # checking the stored objects needs it: timed apart from the planning
    with phases.timed("plan"):
        return _prepare(hf_dir, mcore_dir)


def _prepare(hf_dir: str | Path, mcore_dir: str | Path) -> VerifyJob:
    check_pair("verify", hf_dir, mcore_dir)  # the arguments swapped, or a checkpoint of the wrong kind
    ignored = check_same_model(hf_dir, mcore_dir)  # a checkpoint of another model: before its args are read
    mc = export_job.source_job(mcore_dir, config=hf_dir)
    export_job.check_loadable(mc.src, mc.source)  # every stored object a trainer will load
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
    return VerifyJob(hf=hf, mcore=mc, pairs=pairs, left_out=left, config_keys_ignored=ignored)


@dataclass(frozen=True)
class VerifyOptions:
    workers: int = DEFAULT_WORKERS  # processes on this machine (under torchrun, one per rank)
    threads: int = DEFAULT_THREADS  # reading and comparing ahead of the tally, per worker (0: one step at a time)
    device: str = DEFAULT_DEVICE  # where FP8 is dequantised, as convert's --device
    progress: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


def verify(job: VerifyJob, opts: VerifyOptions = VerifyOptions()) -> JsonObject:
    """Compare every pair; the summary says whether all are equal, with the first and the worst mismatch (the
    same whatever the workers and threads: mismatches are put back in the pairs' order)."""

    require_device(opts.device)  # no GPU: refused now
    start = time.monotonic()
    nbytes = sum(hf_m.hf_bytes + mc_m.mcore_bytes for hf_m, mc_m in job.pairs)  # both sides are read
    workers, why = capped(opts.workers, nbytes, len(job.pairs), "mapping", "mappings")
    phases.import_torch()
    with workers_bar(workers, opts.progress):  # a worker killed with its bar up: erased before the message
        got = run_ranks(verify_rank, (job, dataclasses.replace(opts, workers=workers)), workers, "verify")
    return {**summary(job, got["found"], time.monotonic() - start), "workers": workers,
            "workers_requested": opts.workers,
            "workers_capped": why, "phases": phases.merged(got.get("phases"), phases.take())}


def verify_rank(job: VerifyJob, opts: VerifyOptions, rank: int, world: int, group: Group) -> dict[str, Any]:
    """One rank's share of the pairs; every rank returns all mismatches, in the pairs' order."""

    mine = pair_share(job, rank, world)
    total = sum(job.pairs[i][1].mcore_bytes for i in mine)
    tensors = sum(len(job.pairs[i][1].mcore) for i in mine)  # what the summary counts: Megatron tensors, not pairs
    with progress(rank_label("verify", rank, world), total, tensors, opts.progress and progress_here(rank),
                  "Megatron tensors") as prog, phases.timed("compare"):
        outcome = try_(lambda: compare_share(job, mine, prog, opts, rank, world))
    gathered = gather(group, outcome, world)
    error = next((r for r in gathered if isinstance(r, str)), None)
    if error:
        raise GlmconvError(error)
    results = [r for r in gathered if not isinstance(r, str)]
    tagged = sorted((t for r in results for t in r), key=lambda t: t[0])  # stable: steps keep their order
    return {"found": [m for _, m in tagged], "phases": phases.take() if rank == 0 else {}}


def pair_share(job: VerifyJob, rank: int, world: int) -> list[int]:
    """Indices of this rank's pairs, in order, balanced by bytes as convert's shares are."""
    index = {id(hf_m): i for i, (hf_m, _) in enumerate(job.pairs)}
    return sorted(index[id(m)] for m in shares([hf_m for hf_m, _ in job.pairs], world)[rank])


def compare_share(job: VerifyJob, mine: list[int], prog: Progress, opts: VerifyOptions, rank: int,
                  world: int) -> list[tuple[int, Mismatch]]:
    """Compare pairs `mine` on `opts.threads` threads (each with its own DcpReader), FP8 dequantised where
    convert would dequantise it; mismatches tagged with their pair's index."""

    readers = ThreadReaders(job.mcore.src, True, job.mcore.source)  # a non-finite value is refused, never compared
    fp8 = convert.fp8_bytes([job.pairs[i][0] for i in mine])
    found: list[tuple[int, Mismatch]] = []

    def steps(source: HfTensorSource) -> Iterator[Step[Compared]]:
        for i in mine:
            yield from compare_steps(i, *job.pairs[i], source, readers, job.mcore.stored_rows, opts.chunk_bytes)

    with share_dequantizer(opts.device, fp8, convert.fp8_thread_count(world), rank) as (_, dequantize), \
            HfTensorSource(job.hf.files, dequantize=dequantize, reuse_buffers=True) as source, \
            closing(run_ahead(steps(source), opts.threads)) as made:  # its threads end before the files
        for i, nbytes, last, mismatches in made:
            found.extend((i, m) for m in mismatches)
            prog.advance(nbytes, len(job.pairs[i][1].mcore) if last else 0)
    return found


def compare_steps(i: int, hf_m: Mapping, mc_m: Mapping, source: HfTensorSource, readers: ThreadReaders,
                  stored_rows: dict[str, int], chunk_bytes: int) -> Iterator[Step[Compared]]:
    """Pair `i` as `run_ahead` steps, each reading on its thread's reader and comparing both ways; a step makes
    one chunk: (i, Megatron bytes compared, whether it ends the pair, its mismatches)."""
    steps = hf_m.row_steps(chunk_bytes)
    if steps is None:
        yield Step(0, lambda: [(i, mc_m.mcore_bytes, True, list(compare_whole(hf_m, mc_m, source, readers.get(),
                                                                              stored_rows)))])
        return
    total, n = mc_m.mcore_bytes, max(mc_m.mcore[0].shape[0], 1)
    for k, (rows, picks) in enumerate(steps):
        nbytes, last = total * rows.stop // n - total * rows.start // n, k == len(steps) - 1
        yield _rows_step(i, hf_m, mc_m, source, readers, rows, picks, nbytes, last)


def _rows_step(i: int, hf_m: Mapping, mc_m: Mapping, source: HfTensorSource, readers: ThreadReaders,
               rows: range, picks: list[int], nbytes: int, last: bool) -> Step[Compared]:
    """Rows `rows` of pair `i` compared both ways, on the thread's own reader."""
    return Step(0, lambda: [(i, nbytes, last, list(compare_rows(hf_m, mc_m, source, readers.get(), rows, picks)))])


def compare_whole(hf_m: Mapping, mc_m: Mapping, source: HfTensorSource, reader: DcpReader,
                  stored_rows: dict[str, int]) -> Iterator[Mismatch]:
    """A mapping read whole, both ways."""
    dtype = _dtype(mc_m)
    transform = hf_m.rule.transform
    hf = [source.weight(t.name, dtype) for t in hf_m.hf]
    stored = [reader.read(t.name, (0, t.shape[0]) if t.name in stored_rows else None) for t in mc_m.mcore]
    back = transform.backward(stored, [t.shape for t in hf_m.hf])
    yield from _step(hf_m, range(len(hf_m.hf)), hf, lambda: transform.forward(hf, len(stored)), stored, back, None)


def compare_rows(hf_m: Mapping, mc_m: Mapping, source: HfTensorSource, reader: DcpReader, rows: range,
                 picks: list[int]) -> Iterator[Mismatch]:
    """A window of stacked experts, both ways."""
    dtype = _dtype(mc_m)
    transform = hf_m.rule.transform
    hf = [source.weight(hf_m.hf[i].name, dtype) for i in picks]
    stored = [reader.read(mc_m.mcore[0].name, (rows.start, rows.stop))]
    back = transform.backward(stored, [])
    yield from _step(hf_m, picks, hf, lambda: transform.forward(hf, 1), stored, back, (rows.start, rows.stop))


def _dtype(mc_m: Mapping) -> torch.dtype:
    return torch_dtype(mc_m.mcore[0].dtype)


def _step(m: Mapping, picks: range | list[int], hf: list[torch.Tensor], mine: Callable[[], list[torch.Tensor]],
          stored: list[torch.Tensor], back: list[torch.Tensor], rows: tuple[int, int] | None) -> Iterator[Mismatch]:
    """Backward against the HF tensors, forward (`mine()`) against the stored Megatron ones: a Mismatch when any
    bit differs. An exact inverse that gives the HF bits back proves the forward direction too, unbuilt (the
    stacks and concatenations verify would otherwise copy); anything else runs both."""
    backward = [differ(a, b) for a, b in zip(back, hf, strict=True)]
    if m.rule.transform.exact_inverse and not any(n for n, _ in backward):
        return
    forward = [differ(a, b) for a, b in zip(mine(), stored, strict=True)]
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
    a_bits, b_bits = a.contiguous().view(ints), b.contiguous().view(ints)
    if torch.equal(_words(a_bits), _words(b_bits)):  # the common case, at memory speed (a bool mask's sum: 10x slower)
        return 0, 0.0
    neq = a_bits != b_bits
    n = int(neq.sum())
    if n == 0:
        return 0, 0.0
    diff = (a[neq].double() - b[neq].double()).abs()
    return n, float(torch.nan_to_num(diff, nan=float("inf")).max())


def _words(bits: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte words where they divide evenly: fewer, wider elements to compare."""
    import torch

    flat = bits.reshape(-1).view(torch.uint8)
    return flat.view(torch.int64) if flat.numel() % 8 == 0 else flat


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


def summary(job: VerifyJob, found: list[Mismatch], elapsed: float) -> JsonObject:
    """Counts, the first and the worst mismatch, and up to LISTED of them."""
    plan: Plan = job.mcore.plan
    hf_names = sum(len(hf_m.hf) + sum(1 for s in hf_m.scales if s) for hf_m, _ in job.pairs)
    worst = max(found, key=lambda f: f.max_abs_diff, default=None)
    return {"hf": str(job.hf.src), "mcore": str(job.mcore.src), "iteration": job.mcore.iteration,
            "fp8_source": job.hf.plan.fp8, "mtp": plan.mtp, "vision": plan.vision, "layout": plan.layout,
            "left_out": job.left_out, "config_keys_ignored": job.config_keys_ignored, **dtype_changes(job),
            "mappings": len(job.pairs), "hf_tensors": hf_names, "mcore_tensors": len(plan.mcore_index),
            "bytes": sum(mc.mcore_bytes for _, mc in job.pairs), "equal": not found, "mismatches": len(found),
            "first_mismatch": found[0].as_json() if found else None,
            "worst_mismatch": worst.as_json() if worst else None,
            "listed": [f.as_json() for f in found[:LISTED]], "elapsed_s": round(elapsed, 3)}
