"""Megatron torch_dist -> HF safetensors in the release's naming: the plan run backward, streaming, strict, atomic.

Each mapping's Megatron tensors are read from the `.distcp` chunks (stacked experts a few rows at a time),
turned back into HF tensors by `rule.transform.backward`, cast to the HF dtype (the plan's, or `--like`'s
header dtype where the plan accepts it) and streamed into safetensors files. Which tensor goes into which file,
and the files' names, follow from the data alone (`output_files`: --like's files, or the plan cut at
--max-shard-size), never from the count of workers, ranks or nodes: each rank writes whole files of its own; rank
0 moves them into place, writes the index and sidecars, audits the staged directory against its plan and the
source, then publishes it.

Every HF tensor's name, dtype and shape is known from the plan, so each rank knows its files up front and writes
each file's header before its data (`PlannedShardWriter`): memory is one mapping step (one expert
chunk), never one shard. Where a mapping only moves bytes -- the Megatron dtype is the HF output dtype, the
transform has a `backward_layout`, `--check-finite` is off -- its HF tensors are not read at all: the byte
ranges of the `.distcp` items that hold them are copied file to file by the kernel (`copy_file_range`, as
`cp` does). Anything the reader cannot locate for certain goes through torch.load as before. The zero-copy
path can be switched off (`ExportOptions(zero_copy=False)`, or `GLMCONV_ZERO_COPY=0` in the environment);
both paths write byte-identical files (tests/runners/test_export.py).

FP8 (`--fp8`): the codes are re-quantised and each block's scale moved so that every value dequantises to
exactly the bf16 being exported (`glmconv.numerics.fp8_exact`; why and what was measured: docs/fp8.md). With `--like`
an FP8 checkpoint, each 128x128 block whose --like codes and scale still give back the exported weight keeps
them byte for byte; only the other blocks are re-quantised, and counted (`glmconv.numerics.fp8_reuse`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import phases, space
from glmconv.ahead import Step, run_ahead
from glmconv.defaults import (
    DEFAULT_AHEAD_BYTES,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_DEVICE,
    DEFAULT_SHARD_BYTES,
    DEFAULT_THREADS,
    DEFAULT_WORKERS,
    zero_copy,
)
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io import sidecars
from glmconv.io.byte_copy import Extent, FileCopier
from glmconv.io.file_names import (
    CONFIG_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    SHARD_NAME,
)
from glmconv.io.jsonfile import JsonObject
from glmconv.io.output import check_overlap, manifest_fields, write_new
from glmconv.io.safetensors.like_files import LikeFiles, fit
from glmconv.io.safetensors.like_fp8 import LikeFp8
from glmconv.io.safetensors.reader import HfTensorSource
from glmconv.io.safetensors.writer import PlannedShardWriter, PlannedTensor, Shard, TensorBytes, size_shards
from glmconv.io.torch_dist.byte_route import Span, locate, scanned_extents
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.mistakes import expect_torch_dist
from glmconv.numerics.dequant import require_device
from glmconv.numerics.fp8_encode import Fp8Encoder, share_encoder
from glmconv.plan import FP8, Mapping
from glmconv.progress import Progress
from glmconv.rules import names
from glmconv.runners import audit as audit_mod
from glmconv.runners.backward import (
    Fp8Stats,
    ThreadReaders,
    mapping_hf_steps,
    stored_steps,
)
from glmconv.runners.export_job import (
    LIKE,
    ExportJob,
    check_loadable,
    from_hf,
    from_like_summary,
    is_stripped_padding,
    like_tensors,
    source_job,
)
from glmconv.runners.flow import FlowOptions, PlanRun, balanced, check_once, publish_run
from glmconv.runners.ranks import Group, cores_per_rank
from glmconv.runners.workers import capped

if TYPE_CHECKING:
    import torch

Made = tuple[str, TensorBytes | list[Extent]]  # an HF tensor, made, or its bytes' extents in the .distcp files
_RANK_DIR = ".rank-{:05d}"


@dataclass(frozen=True)
class ExportOptions(FlowOptions):
    """How export runs (what it writes is the job's): processes, threads, the device that encodes FP8, checks."""

    workers: int = DEFAULT_WORKERS
    check_finite: bool = True  # refuse a NaN/Inf in any Megatron tensor read (always: copied bytes are scanned)
    zero_copy: bool = field(default_factory=zero_copy)
    threads: int = DEFAULT_THREADS  # reader/encoder threads per worker, ahead of its writer (0: none)
    ahead_bytes: int = DEFAULT_AHEAD_BYTES  # steps made ahead of the writer hold at most this, per worker
    device: str = DEFAULT_DEVICE  # where FP8 weights are encoded: cpu, cuda, auto (numerics.dequant.resolve_device)
    fp8_threads: int = 0  # CPU encoding threads per worker (0: this worker's share of the cores)


# ---- deciding the plan -------------------------------------------------------------------------------

def prepare(src: str | Path, out: str | Path, *, like: str | Path | None = None, config: str | Path | None = None,
            fp8: bool = False, max_shard_bytes: int | None = None, layout: str | None = None) -> ExportJob:
    """Check the torch_dist checkpoint against the plan its config implies (refuse on any mismatch).

    Shards: `max_shard_bytes` when given; else --like's own files (`glmconv.io.safetensors.like_files`) where
    they hold every tensor; else DEFAULT_SHARD_BYTES."""
    phases.begin()
    with phases.timed("plan"):
        return _prepare(src, out, like=like, config=config, fp8=fp8, max_shard_bytes=max_shard_bytes, layout=layout)


def _prepare(src: str | Path, out: str | Path, *, like: str | Path | None, config: str | Path | None, fp8: bool,
             max_shard_bytes: int | None, layout: str | None) -> ExportJob:
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise GlmconvError(f"--max-shard-size must be positive, got {max_shard_bytes}")
    expect_torch_dist(src, "export")  # an HF directory: convert was meant
    check_overlap(Path(out), _inputs(Path(src), like, config))  # before reading anything
    job = dataclasses.replace(source_job(src, like=like, config=config, fp8=fp8, layout=layout), out=Path(out))
    if max_shard_bytes is not None or job.like is None:
        return dataclasses.replace(job, max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)
    return with_like_files(job)


def with_like_files(job: ExportJob) -> ExportJob:
    """`job` writing --like's own files, or (where they cannot hold its tensors) saying why it cuts by size."""

    assert job.like_source is not None
    planned = [t for m in job.plan.mappings for t in planned_outputs(m, job.dtypes, DEFAULT_CHUNK_BYTES)]
    got = fit(job.like_source, planned)
    if isinstance(got, str):
        return dataclasses.replace(job, like_files_unfit=got)
    return dataclasses.replace(job, like_files=got)


def output_files(job: ExportJob) -> LikeFiles:
    """The files export writes, decided by the data alone (never by the count of workers or ranks): --like's where
    they fit, else the plan's HF tensors in plan order cut at `max_shard_bytes` as safetensors would, named
    `model-i-of-N`, with their index."""
    if job.like_files is not None:
        return job.like_files
    planned = [t for m in job.plan.mappings for t in planned_outputs(m, job.dtypes, DEFAULT_CHUNK_BYTES)]
    cut = size_shards(planned, job.max_shard_bytes)
    shards = [dataclasses.replace(s, name=SHARD_NAME.format(i, len(cut))) for i, s in enumerate(cut, 1)]
    weight_map = {t.name: str(s.name) for s in shards for t in s.tensors}
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(weight_map.items()))}
    return LikeFiles(shards, (json.dumps(index, indent=2) + "\n").encode("utf-8"))


def _inputs(src: Path, like: str | Path | None, config: str | Path | None) -> dict[str, Path | None]:
    """What OUT may not overlap: the torch_dist checkpoint, the --like checkpoint, the --config file."""
    return {"input": src, "--like directory": Path(like) if like is not None else None,
            "--config file": Path(config) if config is not None else None}


# ---- producing HF tensors ----------------------------------------------------------------------------


def planned_outputs(m: Mapping, dtypes: dict[str, str], chunk_bytes: int) -> list[PlannedTensor]:
    """The HF tensors `mapping_tensors` yields for `m`, in its order, with the dtype and shape each is written as."""

    steps = m.row_steps(chunk_bytes)
    order = [i for _, picks in steps for i in picks] if steps is not None else range(len(m.hf))
    out = []
    for i in order:
        spec, scale = m.hf[i], m.scales[i]
        dtype = dtypes.get(spec.name, spec.dtype)
        out.append(PlannedTensor(spec.name, dtype, spec.shape))
        if dtype == FP8:
            if scale is None:
                raise CheckpointError(f"{spec.name}: FP8 in the plan without a {names.SCALE_SUFFIX} tensor")
            out.append(PlannedTensor(scale.name, dtypes.get(scale.name, scale.dtype), scale.shape))
    return out


def byte_route(m: Mapping, reader: DcpReader, dtypes: dict[str, str]) -> dict[str, list[Span]] | None:
    """Each HF tensor of `m` as byte spans of its Megatron tensors, when `m` only moves bytes; None otherwise.

    Only where no value changes: every Megatron tensor has the dtype every HF tensor is written as (no cast,
    no FP8), the transform describes its bytes (`backward_layout`) and the reader can locate every byte of the
    Megatron tensors read (their chunks may split any dims).
    """
    layout = m.byte_layout([dtypes.get(t.name, t.dtype) for t in m.hf], backward=True)
    spans = None if layout is None else locate(layout, [t.name for t in m.mcore], [t.nbytes for t in m.hf], reader)
    return None if spans is None else {t.name: s for t, s in zip(m.hf, spans)}


# ---- one rank's share --------------------------------------------------------------------------------

@dataclass
class ShareResult:
    """What one rank wrote and read, for rank 0's checks and summary."""

    rank: int
    weight_map: dict[str, str]  # HF tensor -> shard file in this rank's directory
    total_size: int
    consumed: list[str]
    bytes_read: int
    fp8: Fp8Stats
    device: str = "cpu"  # where this share's FP8 weights were encoded


def like_fp8(job: ExportJob) -> AbstractContextManager[LikeFp8 | None]:
    """--like's FP8 codes and scales to reuse, when both the export and --like are FP8-capable; else None."""

    return LikeFp8(job.like_source) if job.plan.fp8 and job.like_source is not None else nullcontext(None)


def rank_dir(stage: Path, rank: int) -> Path:
    return stage / _RANK_DIR.format(rank)


def run_share(job: ExportJob, share: list[Mapping], rank: int, stage: Path, prog: Progress,
              chunk_bytes: int, check_finite: bool = False, zero_copy: bool = True, threads: int = DEFAULT_THREADS,
              ahead_bytes: int = DEFAULT_AHEAD_BYTES, files: LikeFiles | None = None,
              fp8: Fp8Encoder | None = None) -> ShareResult:
    """Export one worker's mappings into its own files (`files`, `output_files`: whole files per worker), reading,
    transforming and FP8-encoding (`fp8`; None: `fp8_reuse.encode`) on `threads` threads ahead of the writer (at
    most `ahead_bytes` made ahead); the files are those of one process, byte for byte."""

    readers = ThreadReaders(job.src, check_finite, job.source, pin=fp8 is not None and fp8.pinned)
    stats, consumed, copied = Fp8Stats(), list[str](), 0
    if not share:
        return ShareResult(rank, {}, 0, [], 0, stats)
    outputs = [planned_outputs(m, job.dtypes, chunk_bytes) for m in share]
    arrival = [t for ts in outputs for t in ts]
    writer = PlannedShardWriter(rank_dir(stage, rank), arrival, own_shards(files or output_files(job), arrival),
                                sync=True)  # on disk as it goes, not all at the publish

    def steps(like: LikeFp8 | None, like_src: HfTensorSource | None) -> Iterator[Step[Made]]:
        for m, planned in zip(share, outputs):
            yield from export_steps(m, planned, readers, job, chunk_bytes, stats, like,
                                    zero_copy=zero_copy, like_src=like_src, fp8=fp8)
            consumed.extend(t.name for t in m.mcore)  # from --like: accounted for, as the audit says

    try:
        with FileCopier() as copier, like_fp8(job) as like, \
                like_tensors(job.like_source, share, job.from_like) as like_src, \
                closing(run_ahead(steps(like, like_src), threads, ahead_bytes)) as made:  # threads end first
            for name, data in phases.timed_iter(made, "read"):  # the writer waiting for its input
                if isinstance(data, list):  # extents in the .distcp files: copied file to file
                    n = writer.copy(name, data, copier)
                    copied += n
                else:
                    writer.write(name, data)
                    n = data.nbytes
                prog.advance(n)  # once written: bytes and tensors as they reach the shard
    except BaseException:
        writer.abort()
        raise
    weight_map = writer.close()
    return ShareResult(rank, weight_map, writer.total_size, consumed, readers.bytes_read + copied, stats)


def export_steps(m: Mapping, planned: list[PlannedTensor], readers: ThreadReaders, job: ExportJob, chunk_bytes: int,
                 stats: Fp8Stats, like: LikeFp8 | None, *, zero_copy: bool,
                 like_src: HfTensorSource | None = None, fp8: Fp8Encoder | None = None) -> Iterator[Step[Made]]:
    """One mapping's work for `run_ahead`: its byte route (extents, no memory), else its read-and-encode steps,
    each on its thread's own DcpReader (which keeps the one stored chunk it last loaded: steps of a mapping that
    share a chunk on one thread read it once); a mapping SRC lacks (`job.from_like`) is made from --like's."""
    if m.key in job.from_like:
        assert like_src is not None
        steps = mapping_hf_steps(m, from_hf(m, like_src), job.dtypes, chunk_bytes, stats, like, fp8)
    elif (route := byte_route(m, readers.get(), job.dtypes) if zero_copy else None) is not None:
        yield Step(0, lambda: scanned(readers.get(), route, planned))
        return
    else:
        steps = stored_steps(m, readers, job.stored_rows, job.dtypes, chunk_bytes, stats, like, fp8)
    for nbytes, make in steps:
        yield Step(nbytes, _with_bytes(make))


def _with_bytes(make: Callable[[], list[tuple[str, torch.Tensor]]]) -> Callable[[], list[Made]]:
    """`make`, each tensor's bytes taken on the thread that made it (`TensorBytes`: the writer's thread only writes)."""
    return lambda: [(name, TensorBytes.of(t)) for name, t in make()]


def scanned(reader: DcpReader, route: dict[str, list[Span]], planned: list[PlannedTensor]) -> list[Made]:
    """Each planned HF tensor as the extents its bytes are copied from, checked for NaN/Inf."""
    with phases.busy("scan"):
        return [(t.name, scanned_extents(reader, route[t.name], t)) for t in planned]


def own_shards(files: LikeFiles, arrival: list[PlannedTensor]) -> list[Shard]:
    """The files this worker writes (its share is whole `file_groups`: each file's tensors are one worker's)."""
    mine = {t.name for t in arrival}
    return [s for s in files.shards if s.tensors[0].name in mine]


def file_groups(job: ExportJob, files: LikeFiles) -> list[list[Mapping]]:
    """The plan's mappings in groups that share no output file: each group is one worker's at most, so their count
    is the most workers an export can use."""
    file_of = {t.name: i for i, s in enumerate(files.shards) for t in s.tensors}
    group = list(range(len(files.shards)))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    tensor_files = [[file_of[t.name] for t in planned_outputs(m, job.dtypes, DEFAULT_CHUNK_BYTES)]
                    for m in job.plan.mappings]
    for fs in tensor_files:
        for f in fs[1:]:
            group[root(f)] = root(fs[0])
    together: dict[int, list[Mapping]] = {}
    for m, fs in zip(job.plan.mappings, tensor_files):
        together.setdefault(root(fs[0]), []).append(m)
    return list(together.values())


# ---- assembling, verifying, publishing (rank 0) ------------------------------------------------------

def merge_shards(stage: Path, results: list[ShareResult], files: LikeFiles) -> tuple[int, int]:
    """Move every rank's files into the stage under their final names (`output_files`') and write the index (none
    for a single `model.safetensors` --like); (files, total_size)."""
    for r in results:
        for f in sorted(set(r.weight_map.values())):
            os.replace(rank_dir(stage, r.rank) / f, stage / f)
        shutil.rmtree(rank_dir(stage, r.rank), ignore_errors=True)
    if files.index is not None:
        write_new(stage / INDEX_NAME, files.index)
    return len(files.shards), sum(r.total_size for r in results)


def write_sidecars(job: ExportJob, stage: Path, fp8: Fp8Stats | None = None) -> None:
    """config.json (FP8 block only when FP8), and the generation config and tokenizer files: --like's, or else
    those convert stored in the torch_dist checkpoint; glmconv.json records what FP8 encoding did."""
    write_new(stage / CONFIG_NAME, json.dumps(job.config_json, indent=2) + "\n")
    for name, path in job.sidecars.items():
        sidecars.copy_into(path, stage, name)
    manifest = {**manifest_fields(), "source": str(job.src.resolve()), "format": "hf-safetensors",
                "fp8": job.plan.fp8, "mtp": job.plan.mtp, "vision": job.plan.vision, "layout": job.plan.layout,
                "text_prefix": job.plan.text_prefix, "like": str(job.like.resolve()) if job.like else None,
                **origins(job), "fp8_requantized": vars(fp8) if job.plan.fp8 and fp8 is not None else None}
    write_new(stage / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")  # last: the mark of a glmconv export


def origins(job: ExportJob) -> dict[str, Any]:
    """Where the written dtypes and the sidecar files came from (--like wins over convert's record)."""
    return {"dtypes_from": job.dtypes_from, "sidecars_from": job.sidecars_from, "sidecars": sorted(job.sidecars)}


def verify_staged(job: ExportJob, stage: Path) -> None:
    """Audit the staged HF directory against its plan and, through the mapping, against the source."""
    report = audit_mod.audit(stage, against=job.src, accept_flat_prefix=True, config=job.config_path,
                             against_inspected=job.source)
    objects = set(job.plan.mcore_objects())  # a trainer needs them; export reads no object, so it does not
    liked = {t.name for key in job.from_like for t in job.plan.mapping_of_key[key].mcore}  # SRC lacks them
    audit_mod.refuse(stage, [f for f in report.findings if not is_stripped_padding(job, f) and
                             not (f.side == "against" and f.tensor in objects | liked)])


# ---- running: one process, --workers N, or torchrun ranks ---------------------------------------------

def bytes_in(job: ExportJob) -> int:
    """Bytes of Megatron tensor data export reads."""
    return job.plan.mcore_bytes


def bytes_out(job: ExportJob) -> int:
    """Bytes of HF tensor data export writes (each tensor in the dtype it is written as, FP8 scales included)."""
    return sum(t.nbytes for m in job.plan.mappings for t in planned_outputs(m, job.dtypes, DEFAULT_CHUNK_BYTES))


def space_plan(job: ExportJob, check: bool) -> dict[str, Any]:
    """Estimated time and the free space at OUT (glmconv/space.py); `check`: refuse an output that cannot fit."""

    return space.plan(job.out, bytes_in(job), bytes_out(job), fp8=job.plan.fp8, check=check)


def dry_run_summary(job: ExportJob, opts: ExportOptions) -> dict[str, Any]:
    """What export would do: tensors, bytes in and out, the estimated time and the free space at OUT (refused,
    as a real run would be, when it cannot fit unless `opts.space_check` is off)."""
    plan = job.plan
    workers, why = worker_cap(job, opts, file_groups(job, output_files(job)))
    return {"src": str(job.src), "out": str(job.out), "iteration": job.iteration, "fp8": plan.fp8, "mtp": plan.mtp,
            "vision": plan.vision, "layout": plan.layout, "text_prefix": plan.text_prefix,
            "like": str(job.like) if job.like else None,
            "hf_tensors": len(plan.hf_index), "mcore_tensors": len(plan.mcore_index), "bytes_in": bytes_in(job),
            "bytes_out": bytes_out(job), "workers": workers, "workers_requested": opts.workers,
            "workers_capped": why, **shards_from(job), **origins(job),
            **_from_like(job),
            **space_plan(job, opts.space_check)}


def export(job: ExportJob, opts: ExportOptions, *, force: bool = False) -> dict[str, Any]:
    """Run the export; returns the summary rank 0 publishes. Raises GlmconvError on any failure."""
    start = time.monotonic()
    require_device(opts.device)  # no GPU: refused before anything is written
    phases.import_torch()
    with phases.timed("plan"):  # the stored objects' check and the output's files: before any tensor is read
        check_loadable(job.src, job.source)
        run = ExportRun(job, opts)
        workers, why = worker_cap(job, opts, run.groups)
    inputs = _inputs(job.src, job.like, job.config_path)
    run.opts = dataclasses.replace(opts, workers=workers)
    summary = publish_run(run, job.out, inputs, force, workers,
                          (lambda: space_plan(job, True)) if opts.space_check else None)
    return {**summary, "workers_requested": opts.workers, "workers_capped": why,
            "elapsed_s": round(time.monotonic() - start, 3)}


def worker_cap(job: ExportJob, opts: ExportOptions, groups: list[list[Mapping]]) -> tuple[int, str | None]:
    """The workers this run gets, and why fewer than asked (`workers.capped`: bytes, groups of files, cores)."""
    return capped(opts.workers, bytes_in(job), len(groups), "group of output files", "groups of output files")


class ExportRun(PlanRun[ShareResult]):
    """Export's steps of the shared flow: each rank writes whole output files into its own folder; rank 0 moves
    them into place."""

    verb = "export"
    noun = "HF tensors"

    def __init__(self, job: ExportJob, opts: ExportOptions) -> None:
        self.job, self.opts, self.show_progress = job, opts, opts.progress
        self.files = output_files(job)  # decided here, once: every rank writes its part of the same files
        self.groups = file_groups(job, self.files)
        self.world = 1

    def share_of(self, rank: int, world: int) -> list[Mapping]:
        self.world = world
        order = {id(m): i for i, m in enumerate(self.job.plan.mappings)}
        return sorted(balanced(self.groups, world)[rank], key=lambda m: order[id(m)])

    def share_bytes(self, share: list[Mapping]) -> int:
        return sum(t.nbytes for m in share for t in planned_outputs(m, self.job.dtypes, self.opts.chunk_bytes))

    def share_items(self, share: list[Mapping]) -> int:
        return sum(len(planned_outputs(m, self.job.dtypes, self.opts.chunk_bytes)) for m in share)

    def run_share(self, share: list[Mapping], rank: int, stage: Path, prog: Progress, group: Group) -> ShareResult:
        o = self.opts
        threads = o.fp8_threads or cores_per_rank(self.world)
        with share_encoder(o.device, fp8_code_bytes(share, self.job.dtypes), threads, rank) as (device, encoder):
            got = run_share(self.job, share, rank, stage, prog, o.chunk_bytes, o.check_finite, o.zero_copy,
                            o.threads, o.ahead_bytes, self.files, encoder)
        return dataclasses.replace(got, device=device)

    def check(self, results: list[ShareResult]) -> None:
        """Every Megatron tensor consumed once and every HF tensor written once, across all ranks."""
        check_once((n for r in results for n in r.consumed), self.job.plan.mcore_index, "consumed")
        check_once((n for r in results for n in r.weight_map), self.job.plan.hf_index, "written")

    def finish(self, stage: Path, results: list[ShareResult], world: int) -> JsonObject:
        try:
            shards, total = merge_shards(stage, results, self.files)
            write_sidecars(self.job, stage, fp8_stats(results))
            verify_staged(self.job, stage)
        except OSError as exc:
            raise CheckpointError(f"{self.job.out}: cannot write the export ({exc.strerror or exc})") from None
        return summary(self.job, results, shards, total, world)


def fp8_code_bytes(share: list[Mapping], dtypes: dict[str, str]) -> int:
    """Bytes of FP8 codes `share` encodes: what decides `--device auto` (as convert's dequantisation bytes)."""
    return sum(t.nbytes for m in share for t in planned_outputs(m, dtypes, DEFAULT_CHUNK_BYTES) if t.dtype == FP8)


def summary(job: ExportJob, results: list[ShareResult], shards: int, total: int, world: int) -> dict[str, Any]:
    """What was exported: tensors, bytes in (read from .distcp) and out (written), padding, FP8 re-quantisation."""
    fp8 = fp8_stats(results)
    plan = job.plan
    return {"src": str(job.src), "out": str(job.out), "iteration": job.iteration, "fp8": plan.fp8, "mtp": plan.mtp,
            "vision": plan.vision, "layout": plan.layout, "text_prefix": plan.text_prefix,
            "source_text_prefix": job.source_text_prefix,
            "source_fp8": job.source_fp8, "like": str(job.like) if job.like else None, "hf_tensors": len(plan.hf_index),
            "mcore_tensors": len(plan.mcore_index), "bytes_in": sum(r.bytes_read for r in results),
            "bytes_out": total, "shards": shards, **shards_from(job), "workers": world,
            "vocab_padding_stripped": {n: {"stored_rows": rows, "vocab_size": plan.mcore_index[n].shape[0]}
                                       for n, rows in sorted(job.stored_rows.items())},
            "fp8_requantized": vars(fp8) if plan.fp8 else None, **origins(job), **_from_like(job),
            "device": ",".join(sorted({r.device for r in results if r.weight_map})) or "cpu",
            "published": str(job.out)}


def shards_from(job: ExportJob) -> dict[str, Any]:
    """How the shards are cut: as --like's files, or at `max_shard_bytes` (and why not as --like's, if it was given
    without --max-shard-size)."""
    return {"shards_from": LIKE if job.like_files is not None else "max_shard_bytes",
            "max_shard_bytes": None if job.like_files is not None else job.max_shard_bytes,
            "like_files_unfit": job.like_files_unfit}


def _from_like(job: ExportJob) -> dict[str, Any]:
    return from_like_summary(job.plan, job.from_like, job.src, job.like)


def fp8_stats(results: list[ShareResult]) -> Fp8Stats:
    """Every rank's FP8 counts, summed."""
    fp8 = Fp8Stats()
    for r in results:
        fp8.add(r.fp8)
    return fp8
