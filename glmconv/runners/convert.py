"""HF (BF16 or the FP8 release) -> Megatron torch_dist: the plan run forward, streaming, strict, atomic."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import phases, source_dtypes, space
from glmconv.ahead import Step, run_ahead
from glmconv.checkpoint_layout import LAYOUT_KEY, homeless_counts, homeless_line
from glmconv.defaults import (
    DEFAULT_AHEAD_BYTES,
    DEFAULT_DEVICE,
    DEFAULT_GROUP_BYTES,
    DEFAULT_LAYOUT,
    DEFAULT_THREADS,
    DEFAULT_WORKERS,
    DTYPE_CHOICES,
    KEEP,
)
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io import finite, sidecars
from glmconv.io.byte_copy import Extent
from glmconv.io.dtypes import torch_dtype
from glmconv.io.file_names import CONFIG_NAME, MANIFEST_NAME
from glmconv.io.jsonfile import JsonObject
from glmconv.io.output import check_overlap, manifest_fields, write_new
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint
from glmconv.io.safetensors.reader import Dequantize, HfTensorSource
from glmconv.io.torch_dist.torch_save import FileTensor
from glmconv.io.torch_dist.writer import Chunk, DcpWriter, empty_extra_state
from glmconv.megatron_args import build_common_state
from glmconv.mistakes import expect_hf
from glmconv.numerics.dequant import require_device, share_dequantizer
from glmconv.plan import Mapping, Plan, build_plan
from glmconv.progress import Progress
from glmconv.rules import layouts, names
from glmconv.rules.pieces import Piece, take
from glmconv.rules.table import BF16, F32, FP8
from glmconv.runners import audit as audit_mod
from glmconv.runners.flow import FlowOptions, WritesMegatron, check_once, publish_run, shares
from glmconv.runners.job import PlanJob
from glmconv.runners.ranks import Group, cores_per_rank
from glmconv.runners.workers import capped

if TYPE_CHECKING:
    import torch


@dataclass
class ConvertJob(PlanJob):
    """Everything decided before a byte of tensor data is read (sidecars: the source's own files)."""

    files: dict[str, Path]  # HF tensor -> the source file holding it
    left_out: dict[str, int] = field(default_factory=dict)  # part -> HF tensors deliberately not converted

    @property
    def bytes_in(self) -> int:
        """What convert reads: the HF tensors as the source stores them (an F32 save is twice its BF16), scales
        included."""
        return self.plan.hf_bytes

    @property
    def bytes_out(self) -> int:
        """What it writes: the Megatron tensors in their planned dtype."""
        return self.plan.mcore_bytes

    def recast(self, stored: str, megatron: str) -> int:
        """HF tensors stored as `stored` that Megatron gets as `megatron` (F32 -> BF16: narrowed, rounded)."""
        return sum(d == stored for m in self.plan.mappings if m.mcore[0].dtype == megatron for d in m.stored)


def prepare(src: str | Path, out: str | Path, *, mtp: bool = True, vision: bool = True,
            dtype: str = KEEP, layout: str = DEFAULT_LAYOUT) -> ConvertJob:
    """Audit the source against its own plan (refuse on any finding) and fix the conversion plan.

    `dtype` (`keep`, `bf16`, `fp32`): what the Megatron tensors become (the rules' dtype policies); `layout`:
    whose names the Megatron side has (glmconv.rules.layouts).
    """
    phases.begin()
    with phases.timed("plan"):
        return _prepare(src, out, mtp=mtp, vision=vision, dtype=dtype, layout=layout)


def _prepare(src: str | Path, out: str | Path, *, mtp: bool, vision: bool, dtype: str, layout: str) -> ConvertJob:
    if dtype not in DTYPE_CHOICES:
        raise GlmconvError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    layouts.layout(layout)  # an unknown layout: one line, before anything is read
    expect_hf(src, "convert")  # a torch_dist directory: export was meant
    check_overlap(Path(out), {"input": Path(src)})  # before reading anything: OUT may never be, hold or sit in SRC
    return dataclasses.replace(source_job(src, mtp=mtp, vision=vision, dtype=dtype, layout=layout), out=Path(out))


def source_job(src: str | Path, *, mtp: bool = True, vision: bool = True, dtype: str = KEEP,
               layout: str = DEFAULT_LAYOUT) -> ConvertJob:
    """The HF checkpoint audited against its own plan (refused on any finding) and its plan, with no output:
    `prepare` and `glmconv verify` both start here."""
    src_p = Path(src)
    opts = audit_mod.Options(accept_flat_prefix=True)
    side = audit_mod.load_side(src_p, opts)
    if side.kind != audit_mod.HF:
        raise CheckpointError(f"{src_p}: not an HF checkpoint directory (config.json + safetensors)")
    full = audit_mod.plan_side(side, opts)
    findings = [*side.findings, *audit_mod.compare_side(side, opts)]
    if findings:
        f = findings[0]
        more = f" (and {len(findings) - 1} more; run `glmconv audit-names {src_p}`)" if len(findings) > 1 else ""
        where = f" ({f.file})" if f.file else ""
        raise CheckpointError(f"{f.tensor}{where}: {f.kind}: expected {f.expected}, found {f.found}{more}")
    stored = {n: t[1] for n, t in (side.tensors or {}).items()}
    plan = build_plan(full.config, fp8=full.fp8, mtp=full.mtp and mtp, vision=full.vision and vision,
                      text_prefix=full.text_prefix, dtype=dtype, stored=stored, layout=layout)
    left_out = {part: sum(len(m.hf) + sum(1 for s in m.scales if s) for m in full.mappings
                          if m.optional_part(full.config.num_layers) == part)
                for part, keep in (("mtp", plan.mtp), ("vision", plan.vision)) if getattr(full, part) and not keep}
    ck = inspect_hf_checkpoint(src_p)
    files = ck.tensor_files()
    return ConvertJob(src=src_p, out=src_p, plan=plan, files=files, left_out=left_out,
                      sidecars=sidecars.find(src_p))


def peak_bytes(mappings: list[Mapping], group_bytes: int, chunk_bytes: int, threads: int = DEFAULT_THREADS,
               ahead_bytes: int = DEFAULT_AHEAD_BYTES) -> int:
    """Upper bound of tensor memory one worker holds: a write group and the chunks made ahead of it (never more
    than all computed outputs), plus one mapping step in the making per reader thread and one being written.

    Mappings that only move bytes are copied file to file and hold no tensor memory; the rest count.
    """
    computed = [m for m in mappings if not moves_bytes(m)]
    step = max((_step_bytes(m, chunk_bytes) for m in computed), default=0)
    held = group_bytes + (ahead_bytes if threads else 0)
    return min(held, sum(m.mcore_bytes for m in computed)) + (max(threads, 1) + 1) * step


def fp8_bytes(mappings: list[Mapping]) -> int:
    """Bytes of FP8 codes among the HF tensors of `mappings`: what dequantisation has to go through."""
    return sum(t.nbytes for m in mappings for t, d in zip(m.hf, m.stored) if d == FP8)


def fp8_thread_count(workers: int) -> int:
    """CPU dequantisation threads of one worker: its share of this machine's cores."""

    return cores_per_rank(workers)


def moves_bytes(m: Mapping) -> bool:
    """The plan says this mapping is a pure byte move: its HF tensors are stored in the Megatron dtype."""
    return m.byte_layout(list(m.stored)) is not None


def _step_bytes(m: Mapping, chunk_bytes: int) -> int:
    if m.by_rows:
        return min(m.mcore_bytes, max(chunk_bytes, m.mcore_bytes // m.mcore[0].shape[0]))
    return m.mcore_bytes + m.hf_bytes


def mapping_chunks(m: Mapping, source: HfTensorSource, chunk_bytes: int) -> Iterator[Chunk]:
    """The Megatron tensors of one mapping, made here, in order (`mapping_steps` one after the other)."""
    for step in mapping_steps(m, source, chunk_bytes):
        yield from step.make()


def mapping_steps(m: Mapping, source: HfTensorSource, chunk_bytes: int) -> Iterator[Step[Chunk]]:
    """The Megatron tensors of one mapping as independent steps; stacked experts come as dim-0 chunks, never whole.

    Where the mapping only moves bytes (same dtype on both sides, no check to make on the values), the
    chunks are `FileTensor`s: the writer copies the source bytes file to file without reading them. A step's
    `nbytes` is what its chunks hold in memory (`glmconv.ahead` bounds the steps made ahead by it).
    """

    out_dtype = torch_dtype(m.mcore[0].dtype)
    layout = byte_layout(m, source)
    if m.by_rows:
        yield from _row_steps(m, source, chunk_bytes, out_dtype, layout)
    elif layout is not None:
        yield Step(0, lambda: _moved_chunks(m, source, out_dtype, layout))
    else:
        yield Step(m.mcore_bytes, lambda: _computed_chunks(m, source, out_dtype))


def _moved_chunks(m: Mapping, source: HfTensorSource, dtype: torch.dtype, layout: list[list[Piece]]) -> list[Chunk]:
    extents = _scanned(m, source, range(len(m.hf)), dtype)
    return [Chunk(spec.name, _file_tensor(spec.shape, dtype, pieces, extents)) for spec, pieces in zip(m.mcore, layout)]


def _scanned(m: Mapping, source: HfTensorSource, picks: range | list[int], dtype: torch.dtype) -> list[Extent]:
    """The source extents of `m`'s HF tensors, those in `picks` scanned for NaN/Inf as their bytes are copied."""

    extents = [source.entry(t.name)[1] for t in m.hf]
    for i in picks:
        t, e = m.hf[i], extents[i]
        finite.require_finite_extents([e], dtype, tuple(t.shape), t.name, e.path.name)
    return extents


def _computed_chunks(m: Mapping, source: HfTensorSource, dtype: torch.dtype) -> list[Chunk]:
    if len(m.mcore) == 1:
        return [Chunk(m.mcore[0].name, _assembled(m, source, dtype, range(len(m.hf)), m.mcore[0].shape))]
    hf = [source.weight(t.name, dtype) for t in m.hf]
    return [Chunk(spec.name, tensor.contiguous())
            for spec, tensor in zip(m.mcore, m.rule.transform.forward(hf, len(m.mcore)))]


def _assembled(m: Mapping, source: HfTensorSource, dtype: torch.dtype, picks: Sequence[int],
               shape: tuple[int, ...]) -> torch.Tensor:
    """The mapping's one Megatron tensor (or its rows) from its HF tensors `picks`. Where the transform lays several
    whole inputs one after another (stacked experts, a concatenation on dim 0), each is read or dequantised straight
    into its place in the output; otherwise through the transform (one input: its weight is the output)."""
    import torch

    hf = [m.hf[i] for i in picks]
    layout = m.rule.transform.forward_layout([tuple(t.shape) for t in hf], dtype.itemsize, 1) if len(hf) > 1 else None
    if layout is None or not _whole_inputs(layout[0], [math.prod(t.shape) * dtype.itemsize for t in hf]):
        (tensor,) = m.rule.transform.forward([source.weight(t.name, dtype) for t in hf], 1)
        return tensor.contiguous()
    out = torch.empty(shape, dtype=dtype)
    flat, pos = out.view(-1), 0
    for piece in layout[0]:
        t, n = hf[piece.source], piece.length // dtype.itemsize
        source.weight(t.name, dtype, out=flat[pos:pos + n].view(tuple(t.shape)))
        pos += n
    return out


def _whole_inputs(pieces: list[Piece], sizes: list[int]) -> bool:
    """Whether a byte layout is each input whole, once each (in any order)."""
    return (sorted(p.source for p in pieces) == list(range(len(sizes)))
            and all(p.offset == 0 and p.length == sizes[p.source] for p in pieces))


def byte_layout(m: Mapping, source: HfTensorSource) -> list[list[Piece]] | None:
    """The transform's byte layout when this mapping is a pure byte move on this source, else None."""
    return m.byte_layout([source.stored_dtype(t.name) for t in m.hf])


def _file_tensor(shape: tuple[int, ...], dtype: torch.dtype, pieces: list[Piece], extents: list[Extent]) -> FileTensor:
    import torch

    return FileTensor(torch.Size(shape), dtype, tuple(
        Extent(extents[p.source].path, extents[p.source].offset + p.offset, p.length) for p in pieces))


def _row_steps(m: Mapping, source: HfTensorSource, chunk_bytes: int, dtype: torch.dtype,
               layout: list[list[Piece]] | None) -> Iterator[Step[Chunk]]:
    spec = m.mcore[0]
    row_bytes = spec.nbytes // spec.shape[0]
    for rows, picks in m.row_steps(chunk_bytes) or []:
        yield _row_step(m, source, dtype, layout, rows, picks, row_bytes)


def _row_step(m: Mapping, source: HfTensorSource, dtype: torch.dtype, layout: list[list[Piece]] | None,
              rows: range, picks: list[int], row_bytes: int) -> Step[Chunk]:
    """One dim-0 chunk: its bytes moved file to file (no memory held), or computed."""
    if layout is not None:
        return Step(0, lambda: [_moved_rows(m, source, dtype, layout[0], rows, picks, row_bytes)])
    return Step(len(rows) * row_bytes, lambda: [_computed_rows(m, source, dtype, rows, picks)])


def _moved_rows(m: Mapping, source: HfTensorSource, dtype: torch.dtype, layout: list[Piece], rows: range,
                picks: range | list[int], row_bytes: int) -> Chunk:

    spec = m.mcore[0]
    extents = _scanned(m, source, picks, dtype)
    pieces = take(layout, rows.start * row_bytes, rows.stop * row_bytes)
    shape = (len(rows), *spec.shape[1:])
    return Chunk(spec.name, _file_tensor(shape, dtype, pieces, extents), row=rows.start, shape=spec.shape)


def _computed_rows(m: Mapping, source: HfTensorSource, dtype: torch.dtype, rows: range, picks: list[int]) -> Chunk:
    spec = m.mcore[0]
    chunk = _assembled(m, source, dtype, picks, (len(rows), *spec.shape[1:]))
    return Chunk(spec.name, chunk, row=rows.start, shape=spec.shape)


@dataclass
class ShareResult:
    consumed: list[str]
    written: int
    bytes_in: int
    device: str = "cpu"  # where this share's FP8 weights were dequantised


def run_share(job: ConvertJob, share: list[Mapping], writer: DcpWriter, progress: Progress, *, group_bytes: int,
              chunk_bytes: int, check_finite: bool = False, threads: int = DEFAULT_THREADS,
              ahead_bytes: int = DEFAULT_AHEAD_BYTES, dequantize: Dequantize | None = None) -> ShareResult:
    """Convert one worker's mappings into its own data files, reading and dequantising on `threads` threads
    ahead of the writer (at most `ahead_bytes` made ahead), FP8 by `dequantize` (glmconv/numerics/dequant.py; None:
    the reference call); the files are those of the serial path, byte for byte.
    """

    consumed: list[str] = []
    state = {"written": 0, "bytes": 0}

    def steps(source: HfTensorSource) -> Iterator[Step[Chunk]]:
        for m in share:
            yield from mapping_steps(m, source, chunk_bytes)
            consumed.extend(t.name for t in m.hf)  # a step that fails later raises: nothing is then checked
            consumed.extend(s.name for s in m.scales if s)
            state["written"] += len(m.mcore)
            state["bytes"] += m.hf_bytes  # the writer counts bytes on `progress` as it writes them

    with HfTensorSource(job.files, check_finite=check_finite, dequantize=dequantize, reuse_buffers=True) as source, \
            closing(run_ahead(steps(source), threads, ahead_bytes)) as chunks:  # its threads end before the files
        writer.write_stream(phases.timed_iter(chunks, "read"), group_bytes)  # the writer waiting for its input
    return ShareResult(consumed=consumed, written=state["written"], bytes_in=state["bytes"])


# ---- sidecars and verification --------------------------------------------------------------------------

def write_sidecars(job: ConvertJob, stage: Path) -> None:
    """The config (so audit and export know the model), the source's HF sidecar files, and a manifest of what was
    done: with the source's dtypes and the sidecars' sha256, export restores both without --like."""
    write_new(stage / CONFIG_NAME, json.dumps(job.plan.config.to_json(), indent=2) + "\n")
    hashes = sidecars.store(job.sidecars, stage)
    manifest = {**manifest_fields(), "source": str(job.src.resolve()), "fp8_source": job.plan.fp8, "mtp": job.plan.mtp,
                "vision": job.plan.vision, "text_prefix": job.plan.text_prefix, **layout_summary(job.plan),
                "hf_tensors": len(job.plan.hf_index), "mcore_tensors": len(job.plan.mcore_index),
                "bytes_in": job.bytes_in, "bytes_out": job.bytes_out, "left_out": job.left_out,
                **dtype_summary(job), source_dtypes.KEY: source_dtypes.record(job.plan), sidecars.KEY: hashes}
    write_new(stage / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")


def layout_summary(plan: Plan) -> dict[str, Any]:
    """The layout, and what in it no module of its trainer loads: HF tensors per kind, kept for export."""
    return {LAYOUT_KEY: plan.layout, "homeless": homeless_counts(plan), "homeless_warning": homeless_line(plan)}


def dtype_summary(job: ConvertJob) -> dict[str, Any]:
    """--dtype and what it did: HF tensors rounded F32 -> BF16 (never silent) and widened BF16 -> F32."""
    return {"dtype": job.plan.dtype, "narrowed_f32_to_bf16": job.recast(F32, BF16),
            "widened_bf16_to_f32": job.recast(BF16, F32)}


def verify_staged(job: ConvertJob, stage: Path) -> None:
    """Re-read what was written (DCP metadata) and audit it against the source, both ways.

    The source itself was audited in full by `prepare`; here it is only cross-checked through the plan of the
    parts kept, so that --no-mtp / --no-vision do not report the parts left out as unexpected source tensors.
    """
    opts = audit_mod.Options(mtp=job.plan.mtp, vision=job.plan.vision, accept_flat_prefix=True,
                             layout=job.plan.layout)
    audit_mod.refuse(stage, audit_mod.output_findings(job.src, stage, opts, opts))


# ---- running: one process, --workers N, or torchrun ranks ---------------------------------------------

@dataclass(frozen=True)
class RunOptions(FlowOptions):
    """How convert runs (not what it writes: that is the job's): processes, memory, progress, checks."""

    workers: int = DEFAULT_WORKERS
    group_bytes: int = DEFAULT_GROUP_BYTES
    check_finite: bool = True  # refuse a NaN/Inf in any source tensor (always: copied bytes are scanned)
    threads: int = DEFAULT_THREADS  # reader/dequantiser threads per worker, ahead of its writer (0: none)
    device: str = DEFAULT_DEVICE  # where FP8 is dequantised: cpu, cuda, auto (numerics.dequant.resolve_device)
    fp8_threads: int = 0  # CPU dequantisation threads per worker (0: this worker's share of the cores)
    ahead_bytes: int = DEFAULT_AHEAD_BYTES  # chunks made ahead of the writer hold at most this, per worker


def space_plan(job: ConvertJob, check: bool) -> dict[str, Any]:
    """Estimated time and the free space at OUT (glmconv/space.py); `check`: refuse an output that cannot fit."""

    return space.plan(job.out, job.bytes_in, job.bytes_out, fp8=job.plan.fp8, check=check)


def dry_run_summary(job: ConvertJob, opts: RunOptions) -> dict[str, Any]:
    """What convert would do: tensors, bytes in and out, per-worker share and peak memory, the estimated time and
    the free space at OUT (refused, as a real run would be, when it cannot fit unless `opts.space_check` is off)."""
    workers, why = worker_cap(job, opts)
    return {**plan_summary(job, dataclasses.replace(opts, workers=workers)), "workers_requested": opts.workers,
            "workers_capped": why, **space_plan(job, opts.space_check)}


def worker_cap(job: ConvertJob, opts: RunOptions) -> tuple[int, str | None]:
    """The workers this run gets, and why fewer than asked (`workers.capped`: bytes, mappings, cores)."""
    return capped(opts.workers, job.bytes_in, len(job.plan.mappings), "mapping", "mappings")


def plan_summary(job: ConvertJob, opts: RunOptions) -> dict[str, Any]:
    """Tensors, bytes in and out, per-worker share and peak memory."""
    parts = shares(job.plan.mappings, opts.workers)
    return {"src": str(job.src), "out": str(job.out), "fp8_source": job.plan.fp8, "mtp": job.plan.mtp,
            "vision": job.plan.vision, "text_prefix": job.plan.text_prefix, **layout_summary(job.plan),
            "hf_tensors": len(job.plan.hf_index), "mcore_tensors": len(job.plan.mcore_index),
            "bytes_in": job.bytes_in, "bytes_out": job.bytes_out, "left_out": job.left_out, **dtype_summary(job),
            "sidecars": sorted(job.sidecars), "device": opts.device, "read_threads": opts.threads,
            "workers": [{"rank": r, "mappings": len(p), "bytes_in": sum(m.hf_bytes for m in p),
                         "peak_bytes_estimate": peak_bytes(p, opts.group_bytes, opts.chunk_bytes, opts.threads,
                                                           opts.ahead_bytes)}
                        for r, p in enumerate(parts)]}


def convert(job: ConvertJob, opts: RunOptions, *, force: bool = False) -> dict[str, Any]:
    """Run the conversion; returns the summary rank 0 publishes. Raises GlmconvError on any failure."""

    require_device(opts.device)  # no GPU: refused before anything is written
    workers, why = worker_cap(job, opts)
    phases.import_torch()
    summary = publish_run(ConvertRun(job, dataclasses.replace(opts, workers=workers)), job.out, {"input": job.src},
                          force, workers, (lambda: space_plan(job, True)) if opts.space_check else None)
    return {**summary, "workers_requested": opts.workers, "workers_capped": why}


class ConvertRun(WritesMegatron[ShareResult]):
    """Convert's steps of the shared flow: each rank writes its own DCP data files; rank 0 the metadata."""

    verb = "convert"

    def __init__(self, job: ConvertJob, opts: RunOptions) -> None:
        self.job, self.opts, self.show_progress = job, opts, opts.progress
        self._writer: DcpWriter | None = None  # this rank's writer, made in its own process
        self.world = 1

    def share_of(self, rank: int, world: int) -> list[Mapping]:
        self.world = world
        return shares(self.job.plan.mappings, world)[rank]

    def run_share(self, share: list[Mapping], rank: int, stage: Path, prog: Progress, group: Group) -> ShareResult:
        self._writer = DcpWriter(stage, specs=self.job.plan.mcore_index, group=group, progress=prog,
                                 kept=names.is_kept)
        o = self.opts
        with share_dequantizer(o.device, fp8_bytes(share), o.fp8_threads or fp8_thread_count(self.world),
                               rank) as (device, dequantize):
            result = run_share(self.job, share, self._writer, prog, group_bytes=o.group_bytes,
                               chunk_bytes=o.chunk_bytes, check_finite=o.check_finite, threads=o.threads,
                               ahead_bytes=o.ahead_bytes, dequantize=dequantize)
        return dataclasses.replace(result, device=device)

    def check(self, results: list[ShareResult]) -> None:
        check_once((n for r in results for n in r.consumed), self.job.plan.hf_index, "consumed")

    def after_check(self, rank: int, stage: Path, group: Group) -> None:
        """The `_extra_state` objects (rank 0), then DCP's global metadata and the common state, collectively."""

        assert self._writer is not None  # run_share made it, on this rank
        if rank == 0:
            self._writer.write_objects({key: empty_extra_state() for key in self.job.plan.mcore_objects()})
        self._writer.finish(build_common_state(self.job.plan.config, layout=self.job.plan.layout) if rank == 0
                            else None)

    def finish(self, stage: Path, results: list[ShareResult], world: int) -> JsonObject:
        write_sidecars(self.job, stage)
        verify_staged(self.job, stage)
        devices = ",".join(sorted({r.device for r in results}))
        return {**plan_summary(self.job, dataclasses.replace(self.opts, workers=world)), "device": devices,
                "published": str(self.job.out)}
