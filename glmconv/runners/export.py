"""Megatron torch_dist -> HF safetensors in the release's naming: the plan run backward, streaming, strict, atomic.

Each mapping's Megatron tensors are read from the `.distcp` chunks (stacked experts a few rows at a time),
turned back into HF tensors by `rule.transform.backward`, cast to the HF dtype (the plan's, or `--like`'s
header dtype where the plan accepts it) and streamed into safetensors shards; rank 0 names the shards, writes
the index and sidecars, audits the staged directory against its plan and the source, then publishes it.

Every HF tensor's name, dtype and shape is known from the plan, so each rank plans its shards up front and
writes each shard's header before its data (`PlannedShardWriter`): memory is one mapping step (one expert
chunk), never one shard. Where a mapping only moves bytes -- the Megatron dtype is the HF output dtype, the
transform has a `backward_layout`, `--check-finite` is off -- its HF tensors are not read at all: the byte
ranges of the `.distcp` items that hold them are copied file to file by the kernel (`copy_file_range`, as
`cp` does). Anything the reader cannot locate for certain goes through torch.load as before. The zero-copy
path can be switched off (`ExportOptions(zero_copy=False)`, or `GLMCONV_ZERO_COPY=0` in the environment);
both paths write byte-identical files (tests/test_export.py).

FP8 (`--fp8`): the codes are re-quantised and each block's scale moved so that every value dequantises to
exactly the bf16 being exported (`glmconv.io.fp8_exact`; why and what was measured: docs/fp8.md). With `--like`
an FP8 checkpoint, each 128x128 block whose --like codes and scale still give back the exported weight keeps
them byte for byte; only the other blocks are re-quantised, and counted (`glmconv.io.fp8_reuse`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import source_dtypes
from glmconv.config import GlmConfig, load_config
from glmconv.errors import CheckpointError, ConfigError, GlmconvError
from glmconv.io import sidecars
from glmconv.io.checkpoint_files import optional_file
from glmconv.io.file_names import (
    COMMON_PT_NAME,
    COMMON_STATE_KEY,
    CONFIG_NAME,
    DCP_METADATA_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    SHARD_NAME,
)
from glmconv.io.jsonfile import load_json_file
from glmconv.io.safetensors.checkpoint import HfCheckpoint, inspect_hf_checkpoint
from glmconv.io.torch_dist.metadata import DcpCheckpoint, inspect_torch_dist
from glmconv.io.torch_dist.metadata import config_path as mcore_config_path
from glmconv.mistakes import expect_torch_dist
from glmconv.output import check_overlap, copy_new, manifest_fields, write_new
from glmconv.plan import FP8, Mapping, Plan, TensorSpec, build_plan, retyped
from glmconv.rules import names
from glmconv.runners import audit as audit_mod
from glmconv.runners.ahead import DEFAULT_AHEAD_BYTES, DEFAULT_THREADS, Step, run_ahead
from glmconv.runners.flow import DEFAULT_CHUNK_BYTES, PlanRun, balanced, check_once, publish_run, shares
from glmconv.text import count
from glmconv.weight_sync import Fp8Stats, Read, mapping_hf, mapping_hf_steps

if TYPE_CHECKING:
    import torch

    from glmconv.io.byte_copy import Extent
    from glmconv.io.fp8_reuse import LikeFp8
    from glmconv.io.jsonfile import JsonObject
    from glmconv.io.safetensors.like_files import LikeFiles
    from glmconv.io.safetensors.reader import HfTensorSource
    from glmconv.io.safetensors.writer import PlannedTensor, Shard
    from glmconv.io.torch_dist.reader import DcpReader
    from glmconv.progress import Progress
    from glmconv.runners.ranks import Group

    Made = tuple[str, "torch.Tensor | list[Extent]"]  # an HF tensor, made, or its bytes' extents in the .distcp files

DEFAULT_SHARD_BYTES = 5 * 10**9
ZERO_COPY_ENV = "GLMCONV_ZERO_COPY"  # "0": never copy bytes file to file, always read through torch.load
VOCAB_DIM = "vocab"
LIKE, CONVERTED, PLAN = "--like", "converted checkpoint", "plan"  # where dtypes and sidecars come from
_RANK_DIR = ".rank-{:05d}"


@dataclass
class ExportJob:
    """Everything decided before a byte of tensor data is read."""

    src: Path
    out: Path  # `source_job` leaves the source here: only `prepare` names an output
    plan: Plan
    config_json: dict[str, Any]
    dtypes: dict[str, str]  # HF tensor (and FP8 scale) -> safetensors dtype to write
    stored_rows: dict[str, int] = field(default_factory=dict)  # vocab-padded Megatron tensors: rows on disk
    iteration: str = ""
    like: Path | None = None
    config_path: Path | None = None
    source_text_prefix: str | None = None  # from convert's manifest, when there is one
    source_fp8: bool | None = None
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    like_files: LikeFiles | None = None  # --like's own files, when no --max-shard-size is given and they fit
    like_files_unfit: str | None = None  # why --like's files could not be followed (shards cut by size instead)
    sidecars: dict[str, Path] = field(default_factory=dict)  # HF files to copy: --like's, else convert's record
    dtypes_from: str = PLAN  # LIKE, CONVERTED (glmconv.json's record) or PLAN (an older glmconv's checkpoint)
    sidecars_from: str | None = None  # LIKE, CONVERTED or None
    from_like: frozenset[tuple[str, ...]] = frozenset()  # keys of homeless mappings SRC lacks, taken from --like


@dataclass(frozen=True)
class ExportOptions:
    workers: int = 1
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    progress: bool = True
    check_finite: bool = True  # refuse a NaN/Inf in any Megatron tensor read (always: copied bytes are scanned)
    zero_copy: bool = field(default_factory=lambda: os.environ.get(ZERO_COPY_ENV, "1") != "0")
    space_check: bool = True  # refuse up front an output that cannot fit on OUT's filesystem
    threads: int = DEFAULT_THREADS  # reader/encoder threads per worker, ahead of its writer (0: none)
    ahead_bytes: int = DEFAULT_AHEAD_BYTES  # steps made ahead of the writer hold at most this, per worker


# ---- deciding the plan -------------------------------------------------------------------------------

def prepare(src: str | Path, out: str | Path, *, like: str | Path | None = None, config: str | Path | None = None,
            fp8: bool = False, max_shard_bytes: int | None = None, layout: str | None = None) -> ExportJob:
    """Check the torch_dist checkpoint against the plan its config implies (refuse on any mismatch).

    Shards: `max_shard_bytes` when given; else --like's own files (`glmconv.io.safetensors.like_files`) where
    they hold every tensor; else DEFAULT_SHARD_BYTES."""
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
    from glmconv.io.safetensors.like_files import fit

    assert job.like is not None
    planned = [t for m in job.plan.mappings for t in planned_outputs(m, job.dtypes, DEFAULT_CHUNK_BYTES)]
    got = fit(job.like, planned)
    if isinstance(got, str):
        return dataclasses.replace(job, like_files_unfit=got)
    return dataclasses.replace(job, like_files=got)


def source_job(src: str | Path, *, like: str | Path | None = None, config: str | Path | None = None,
               fp8: bool = False, layout: str | None = None, config_option: str | None = "--config") -> ExportJob:
    """What export would write from `src`, decided and checked (plan, stored args, shapes, dtypes), with no output:
    `prepare` and the weight-sync API (`glmconv.weight_sync`) both start here.

    `layout`: the Megatron layout to read `src` in; None: the one glmconv.json records, else the one its names
    are spelled in (glmconv.checkpoint_layout). Tensors kept under glmconv_kept. are exported like any other;
    where SRC has none (its trainer, with no parameter for them, saved none), they come unchanged from --like.
    `config_option`: the caller's option naming a config.json, offered when `src` has none (None: no option)."""
    from glmconv.checkpoint_layout import checkpoint_layout
    from glmconv.io.torch_dist.common_state import read_common_state
    from glmconv.megatron_args import check_stored_args

    src_p = Path(src)
    ck = inspect_torch_dist(src_p)
    if ck.common_state is None:
        raise CheckpointError(f"{ck.iter_dir}: common state missing: no {COMMON_PT_NAME} and no {COMMON_STATE_KEY} "
                              f"entry in {DCP_METADATA_NAME} (a Megatron checkpoint always has one)")
    common = read_common_state(ck.iter_dir)
    cfg_path = Path(config) if config is not None else mcore_config_path(src_p, ck.iter_dir, config_option)
    cfg = load_config(cfg_path)
    check_stored_args(common.get("args"), cfg, str(ck.iter_dir))  # another model than its config: refused now
    like_ck = inspect_hf_checkpoint(like) if like is not None else None
    if like_ck is not None:
        _check_like_config(cfg, like_ck)
    prefix = (like_ck.text_prefix if like_ck is not None else None) or names.HF_TEXT_PREFIX
    parts = names.mcore_parts_present(ck.tensors)
    plan = build_plan(cfg, fp8=fp8, mtp="mtp" in parts, vision="vision" in parts, text_prefix=prefix,
                      layout=checkpoint_layout(src_p, cfg, ck.tensors, layout))
    from_like = homeless_from_like(plan, ck, like_ck)
    stored_rows = check_source(plan, ck, from_like)
    plan = retyped(plan, {n: ck.tensors[n].dtype for n in plan.mcore_index if n in ck.tensors})
    manifest = _manifest(src_p)
    dtypes, dtypes_from = _dtypes(plan, like_ck, manifest, src_p)
    files, files_from = _sidecars(like_ck, manifest, src_p)  # refused before any work when not plain files inside
    return ExportJob(
        src=src_p, out=src_p, plan=plan, config_json=_config_json(like_ck.config if like_ck else cfg, plan),
        dtypes=dtypes, stored_rows=stored_rows, iteration=str(common.get("iteration", ck.iteration)),
        like=Path(like) if like is not None else None, config_path=Path(config) if config is not None else None,
        source_text_prefix=manifest.get("text_prefix"), source_fp8=manifest.get("fp8_source"),
        sidecars=files, dtypes_from=dtypes_from, sidecars_from=files_from, from_like=from_like)


def homeless_from_like(plan: Plan, ck: DcpCheckpoint, like: HfCheckpoint | None) -> frozenset[tuple[str, ...]]:
    """The homeless mappings (no trainer parameter holds them: the kpool compression in the mcore layout) that SRC
    lacks altogether, as a checkpoint saved by that layout's trainer does: their HF tensors are --like's, which
    training cannot have changed. Without --like, or with a --like that lacks one, refused naming it."""
    absent = [m for m in plan.homeless() if not any(t.name in ck.tensors for t in m.mcore)]
    if not absent:
        return frozenset()
    first = absent[0]
    if like is None:
        more = f" (and {len(absent) - 1} more such mappings)" if len(absent) > 1 else ""
        raise CheckpointError(f"{first.mcore[0].name}: missing from {ck.iter_dir}{more}: the {plan.layout} layout has "
                              f"no trainer parameter for {', '.join(t.name for t in first.hf)}, so a checkpoint its "
                              "trainer saved has none; pass --like with the HF checkpoint training started from")
    for m in absent:
        for t in m.hf:
            got = like.tensors.get(t.name)
            if got is None or got.shape != t.shape:
                found = "absent" if got is None else str(list(got.shape))
                raise CheckpointError(f"{t.name}: {found} in --like {like.path}, expected {list(t.shape)} (SRC has "
                                      f"no {m.mcore[0].name} to export it from)")
    return frozenset(m.key for m in absent)


def _inputs(src: Path, like: str | Path | None, config: str | Path | None) -> dict[str, Path | None]:
    """What OUT may not overlap: the torch_dist checkpoint, the --like checkpoint, the --config file."""
    return {"input": src, "--like directory": Path(like) if like is not None else None,
            "--config file": Path(config) if config is not None else None}


def _manifest(src: Path) -> dict[str, Any]:
    """What convert recorded; the dtype record and the sidecar list are checked where they are used."""
    path = optional_file(src, MANIFEST_NAME)
    data = load_json_file(path, source=str(src / MANIFEST_NAME)) if path is not None else {}
    types = {"text_prefix": str, "fp8_source": bool}  # convert wrote it, anyone may have edited it
    out = {k: data[k] for k, kind in types.items() if isinstance(data, dict) and type(data.get(k)) is kind}
    records = (source_dtypes.KEY, sidecars.KEY)
    return {**out, **{k: data[k] for k in records if isinstance(data, dict) and k in data}}


def _check_like_config(cfg: GlmConfig, like: HfCheckpoint) -> None:
    """--like must describe the same model: every dimension and the layer schedules."""
    a = audit_mod.Side(Path("mcore"), audit_mod.CONFIG, cfg, None)
    b = audit_mod.Side(like.path, audit_mod.CONFIG, like.config, None)
    findings = audit_mod.config_findings(a, b, "like")
    if findings:
        f = findings[0]
        raise ConfigError(f"{like.path / CONFIG_NAME}: --like is another model: {f.tensor} is {f.found}, "
                          f"the torch_dist config says {f.expected}")


def _dtypes(plan: Plan, like: HfCheckpoint | None, manifest: dict[str, Any], src: Path) -> tuple[dict[str, str], str]:
    """The dtype to write per HF tensor and where it comes from: --like's header where the plan accepts it, else
    the source dtypes convert recorded, else (an older glmconv's checkpoint) the plan's."""
    found: dict[str, str] = {}
    if like is not None:
        found = {n: t.dtype for n, t in like.tensors.items()}
    elif source_dtypes.KEY in manifest:
        prefix = manifest.get("text_prefix", names.HF_TEXT_PREFIX)
        found = source_dtypes.restore(plan, manifest[source_dtypes.KEY], prefix, src)
    out = {name: found[name] if name in found and spec.accepts(found[name]) else spec.dtype
           for name, spec in plan.hf_index.items()}
    return out, LIKE if like is not None else CONVERTED if source_dtypes.KEY in manifest else PLAN


def _sidecars(like: HfCheckpoint | None, manifest: dict[str, Any], src: Path) -> tuple[dict[str, Path], str | None]:
    """The HF files to copy: --like's when given (it wins), else those convert stored, checked against its sha256."""
    if like is not None:
        return sidecars.find(like.path), LIKE
    if sidecars.KEY in manifest:
        return sidecars.stored(src, manifest[sidecars.KEY]), CONVERTED
    return {}, None


def _config_json(cfg: GlmConfig, plan: Plan) -> dict[str, Any]:
    """The config to publish: FP8 quantization_config exactly when the tensors are FP8."""
    from glmconv.fixtures.presets import modules_not_converted, quantization_config

    raw = cfg.to_json()
    q = raw.pop("quantization_config", None)
    if plan.fp8:
        fp8_q = isinstance(q, dict) and q.get("quant_method") == "fp8"
        raw["quantization_config"] = q if fp8_q else quantization_config(modules_not_converted(raw))
    return raw


def check_source(plan: Plan, ck: DcpCheckpoint, from_like: frozenset[tuple[str, ...]] = frozenset()) -> dict[str, int]:
    """Every planned Megatron tensor present with its shape and dtype (but those of `from_like` mappings, absent),
    nothing else; returns vocab-padded rows."""
    where = ck.iter_dir
    elsewhere = {t.name for key in from_like for t in plan.mapping_of_key[key].mcore}
    missing = [n for n in plan.mcore_index if n not in ck.tensors and n not in elsewhere]
    if missing:
        needs = ", ".join(t.name for t in plan.mapping_of_mcore[missing[0]].hf)
        more = f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""
        raise CheckpointError(f"{missing[0]}: missing from {where} (needed for {needs}){more}")
    extra = sorted(n for n in set(ck.tensors) - set(plan.mcore_index) if not names.is_training_state(n))
    if extra:
        more = f" ({len(extra)} tensors are not in the plan)" if len(extra) > 1 else ""
        raise CheckpointError(f"{extra[0]}: in {where} but not in the export plan{more}")
    padded: dict[str, int] = {}
    for name, spec in plan.mcore_index.items():
        if name in elsewhere:
            continue
        got = ck.tensors[name]
        if not spec.accepts(got.dtype):
            raise CheckpointError(f"{name}: {got.dtype} in {where}, the plan says {spec.expected_dtypes()}")
        if got.shape != spec.shape:
            padded[name] = padded_rows(plan, spec, got.shape, where)
    return padded


def padded_rows(plan: Plan, spec: TensorSpec, shape: tuple[int, ...], where: str | Path) -> int:
    """Megatron pads the vocabulary to a multiple (of 128 x TP): more rows are stripped, fewer are an error."""
    m = plan.mapping_of_mcore[spec.name]
    vocab = m.rule.shapes[0][0] == VOCAB_DIM
    if vocab and len(shape) == len(spec.shape) and shape[1:] == spec.shape[1:]:
        if shape[0] > spec.shape[0]:
            return shape[0]
        raise CheckpointError(f"{spec.name}: {shape[0]} vocabulary rows in {where}, fewer than vocab_size "
                              f"{spec.shape[0]}")
    raise CheckpointError(f"{spec.name}: {list(shape)} in {where}, the plan says {list(spec.shape)}")


# ---- producing HF tensors ----------------------------------------------------------------------------

def export_mappings(reader: DcpReader, mappings: list[Mapping], dtypes: dict[str, str] | None = None, *,
                    stored_rows: dict[str, int] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    stats: Fp8Stats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors (FP8 weights followed by their scales) of `mappings`, read and transformed one group at a time."""
    for m in mappings:
        yield from mapping_tensors(m, reader, dtypes or {}, stored_rows or {}, chunk_bytes, stats or Fp8Stats())


def mapping_tensors(m: Mapping, reader: DcpReader, dtypes: dict[str, str], stored_rows: dict[str, int],
                    chunk_bytes: int, stats: Fp8Stats,
                    like: LikeFp8 | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One mapping backward, read from the `.distcp` files (a padded vocabulary: its first rows) through the
    weight-sync code (`glmconv.weight_sync.mapping_hf`); stacked experts `chunk_bytes` at a time, never whole."""
    try:
        yield from mapping_hf(m, stored_read(m, lambda: reader, stored_rows), dtypes, chunk_bytes, stats, like)
    finally:
        reader.drop_cache()


def from_hf(m: Mapping, source: HfTensorSource) -> Read:
    """`m`'s Megatron tensors made from HF tensors (`--like`'s): forward, in F32 (BF16 and F32 widen exactly;
    FP8 is dequantised), so that the export path's backward and encoding give them back as stored."""
    import torch

    made: dict[str, torch.Tensor] = {}

    def read(name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        if not made:
            hf = [source.weight(t.name, torch.float32) for t in m.hf]
            made.update(zip((t.name for t in m.mcore), m.rule.transform.forward(hf, len(m.mcore))))
        return made[name] if rows is None else made[name][rows[0]:rows[1]]

    return read


def like_tensors(like: Path | None, share: list[Mapping],
                 from_like: frozenset[tuple[str, ...]]) -> AbstractContextManager[HfTensorSource | None]:
    """--like's tensors, open while this share makes the mappings SRC lacks (export, relayout); None when it has
    none of them."""
    from contextlib import nullcontext

    from glmconv.io.safetensors.checkpoint import shard_path
    from glmconv.io.safetensors.reader import HfTensorSource

    if like is None or not any(m.key in from_like for m in share):
        return nullcontext(None)
    ck = inspect_hf_checkpoint(like)
    return HfTensorSource({n: shard_path(like, t.file) for n, t in ck.tensors.items()})


def stored_read(m: Mapping, reader: Callable[[], DcpReader], stored_rows: dict[str, int]) -> Read:
    """How `mapping_hf` reads `m`'s Megatron tensors: whole ones as stored, a padded vocabulary by its first rows."""
    plain = {t.name: (0, t.shape[0]) if t.name in stored_rows else None for t in m.mcore}
    return lambda name, rows: reader().read(name, plain[name] if rows is None else rows)


def planned_outputs(m: Mapping, dtypes: dict[str, str], chunk_bytes: int) -> list[PlannedTensor]:
    """The HF tensors `mapping_tensors` yields for `m`, in its order, with the dtype and shape each is written as."""
    from glmconv.io.safetensors.writer import PlannedTensor

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


Span = tuple[str, int, int]  # bytes [begin, end) of a Megatron tensor (global, C order)


def byte_route(m: Mapping, reader: DcpReader, dtypes: dict[str, str]) -> dict[str, list[Span]] | None:
    """Each HF tensor of `m` as byte spans of its Megatron tensors, when `m` only moves bytes; None otherwise.

    Only where no value changes: every Megatron tensor has the dtype every HF tensor is written as (no cast,
    no FP8), the transform describes its bytes (`backward_layout`) and the reader can locate every byte of the
    Megatron tensors read (their chunks may split any dims). Spans, not extents: a tensor split along dim 1
    has one extent per row piece, so extents are made one HF tensor at a time (`route_extents`).
    """
    layout = m.byte_layout([dtypes.get(t.name, t.dtype) for t in m.hf], backward=True)
    if layout is None or len(layout) != len(m.hf):
        return None
    route: dict[str, list[Span]] = {}
    for spec, pieces in zip(m.hf, layout):
        spans: list[Span] = []
        for p in pieces:
            if not 0 <= p.source < len(m.mcore):
                return None
            name = m.mcore[p.source].name
            g = reader.grid(name) if reader.locatable(name) else None
            if g is None or p.offset + p.length > g.nbytes:
                return None
            spans.append((name, p.offset, p.offset + p.length))
        if sum(end - begin for _, begin, end in spans) != spec.nbytes:
            return None
        route[spec.name] = spans
    return route


def scanned_extents(reader: DcpReader, spans: list[Span], t: PlannedTensor) -> list[Extent]:
    """`route_extents`, the bytes scanned for NaN/Inf as they are copied (the HF tensor's own index and block)."""
    from glmconv.io.dtypes import TORCH_DTYPES
    from glmconv.io.finite import require_finite_extents

    extents = route_extents(reader, spans)
    require_finite_extents(extents, TORCH_DTYPES[t.dtype], tuple(t.shape), t.name, str(reader.iter_dir))
    return extents


def route_extents(reader: DcpReader, spans: list[Span]) -> list[Extent]:
    """The file extents of one HF tensor's spans, in order (every chunk was located by `byte_route`)."""
    extents: list[Extent] = []
    for name, begin, end in spans:
        found = reader.byte_extents(name, begin, end)
        if found is None:
            raise CheckpointError(f"{name}: bytes {begin}..{end} could not be located after all")
        extents.extend(found)
    return extents


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


def like_fp8(job: ExportJob) -> AbstractContextManager[LikeFp8 | None]:
    """--like's FP8 codes and scales to reuse, when both the export and --like are FP8-capable; else None."""
    from contextlib import nullcontext

    from glmconv.io.fp8_reuse import LikeFp8

    return LikeFp8(job.like) if job.plan.fp8 and job.like is not None else nullcontext(None)


def rank_dir(stage: Path, rank: int) -> Path:
    return stage / _RANK_DIR.format(rank)


def run_share(job: ExportJob, share: list[Mapping], rank: int, stage: Path, prog: Progress,
              chunk_bytes: int, check_finite: bool = False, zero_copy: bool = True, threads: int = DEFAULT_THREADS,
              ahead_bytes: int = DEFAULT_AHEAD_BYTES) -> ShareResult:
    """Export one worker's mappings into its own shards, reading, transforming and FP8-encoding on `threads`
    threads ahead of the writer (at most `ahead_bytes` made ahead); the shards are those of the serial path."""
    from glmconv.io.byte_copy import FileCopier
    from glmconv.io.safetensors.writer import PlannedShardWriter

    readers = ThreadReaders(job.src, check_finite)
    stats, consumed, copied = Fp8Stats(), list[str](), 0
    if not share:
        return ShareResult(rank, {}, 0, [], 0, stats)
    outputs = [planned_outputs(m, job.dtypes, chunk_bytes) for m in share]
    arrival = [t for ts in outputs for t in ts]
    writer = PlannedShardWriter(rank_dir(stage, rank), arrival, own_shards(job, arrival) or job.max_shard_bytes)

    def steps(like: LikeFp8 | None, like_src: HfTensorSource | None) -> Iterator[Step[Made]]:
        for m, planned in zip(share, outputs):
            yield from export_steps(m, planned, readers, job, chunk_bytes, stats, like,
                                    zero_copy=zero_copy, like_src=like_src)
            consumed.extend(t.name for t in m.mcore)  # from --like: accounted for, as the audit says

    try:
        with FileCopier() as copier, like_fp8(job) as like, like_tensors(job.like, share, job.from_like) as like_src, \
                closing(run_ahead(steps(like, like_src), threads, ahead_bytes)) as made:  # threads end first
            for name, data in made:
                if isinstance(data, list):  # extents in the .distcp files: copied file to file
                    n = writer.copy(name, data, copier)
                    copied += n
                else:
                    writer.write(name, data)
                    n = data.numel() * data.element_size()
                prog.advance(n)  # once written: bytes and tensors as they reach the shard
    except BaseException:
        writer.abort()
        raise
    weight_map = writer.close()
    return ShareResult(rank, weight_map, writer.total_size, consumed, readers.bytes_read + copied, stats)


def export_steps(m: Mapping, planned: list[PlannedTensor], readers: ThreadReaders, job: ExportJob, chunk_bytes: int,
                 stats: Fp8Stats, like: LikeFp8 | None, *, zero_copy: bool,
                 like_src: HfTensorSource | None = None) -> Iterator[Step[Made]]:
    """One mapping's work for `run_ahead`: its byte route (extents, no memory), else its read-and-encode steps,
    each on its thread's own DcpReader (which keeps the one stored chunk it last loaded: steps of a mapping that
    share a chunk on one thread read it once); a mapping SRC lacks (`job.from_like`) is made from --like's."""
    if m.key in job.from_like:
        assert like_src is not None
        read = from_hf(m, like_src)
    elif (route := byte_route(m, readers.get(), job.dtypes) if zero_copy else None) is not None:
        yield Step(0, lambda: [(t.name, scanned_extents(readers.get(), route[t.name], t)) for t in planned])
        return
    else:
        read = stored_read(m, readers.get, job.stored_rows)
    for nbytes, make in mapping_hf_steps(m, read, job.dtypes, chunk_bytes, stats, like):
        yield Step(nbytes, make)


class ThreadReaders:
    """One DcpReader per thread, their bytes read summed. Memory: each holds at most one stored chunk."""

    def __init__(self, src: Path, check_finite: bool) -> None:
        import threading

        self._src, self._check_finite = src, check_finite
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[DcpReader] = []

    def get(self) -> DcpReader:
        from glmconv.io.torch_dist.reader import DcpReader

        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._local.reader = DcpReader(self._src, check_finite=self._check_finite)
            with self._lock:
                self._all.append(reader)
        return reader

    @property
    def bytes_read(self) -> int:
        with self._lock:
            return sum(r.bytes_read for r in self._all)


def own_shards(job: ExportJob, arrival: list[PlannedTensor]) -> list[Shard] | None:
    """The --like files this worker writes (`file_shares` gives each file's tensors to one worker); None: none."""
    if job.like_files is None:
        return None
    mine = {t.name for t in arrival}
    return [s for s in job.like_files.shards if s.tensors[0].name in mine]


def file_shares(job: ExportJob, n: int) -> list[list[Mapping]]:
    """The plan split across `n` ranks so that each of --like's files is written by one of them: the mappings
    whose HF tensors share files stay together; those groups are balanced by bytes (`balanced`)."""
    assert job.like_files is not None
    file_of = {t.name: i for i, s in enumerate(job.like_files.shards) for t in s.tensors}
    group = list(range(len(job.like_files.shards)))

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    files = [[file_of[t.name] for t in planned_outputs(m, job.dtypes, DEFAULT_CHUNK_BYTES)] for m in job.plan.mappings]
    for fs in files:
        for f in fs[1:]:
            group[root(f)] = root(fs[0])
    together: dict[int, list[Mapping]] = {}
    for m, fs in zip(job.plan.mappings, files):
        together.setdefault(root(fs[0]), []).append(m)
    return balanced(list(together.values()), n)


# ---- assembling, verifying, publishing (rank 0) ------------------------------------------------------

def merge_shards(stage: Path, results: list[ShareResult], like_files: LikeFiles | None = None) -> tuple[int, int]:
    """Move every rank's shards into the stage under their final names -- --like's, or `model-i-of-N` -- and write
    one index (--like's, which a single `model.safetensors` has none of); (shards, total_size)."""
    if like_files is not None:
        return _merge_like(stage, results, like_files)
    files = [(r.rank, f) for r in sorted(results, key=lambda r: r.rank) for f in sorted(set(r.weight_map.values()))]
    final = {key: SHARD_NAME.format(i, len(files)) for i, key in enumerate(files, 1)}
    for (rank, f), name in final.items():
        os.replace(rank_dir(stage, rank) / f, stage / name)
    for r in results:
        shutil.rmtree(rank_dir(stage, r.rank), ignore_errors=True)
    weight_map = {t: final[(r.rank, f)] for r in results for t, f in r.weight_map.items()}
    total = sum(r.total_size for r in results)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_new(stage / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    return len(files), total


def _merge_like(stage: Path, results: list[ShareResult], like_files: LikeFiles) -> tuple[int, int]:
    for r in results:
        for f in sorted(set(r.weight_map.values())):
            os.replace(rank_dir(stage, r.rank) / f, stage / f)
        shutil.rmtree(rank_dir(stage, r.rank), ignore_errors=True)
    if like_files.index is not None:
        write_new(stage / INDEX_NAME, like_files.index)
    return len(like_files.shards), sum(r.total_size for r in results)


def write_sidecars(job: ExportJob, stage: Path, fp8: Fp8Stats | None = None) -> None:
    """config.json (FP8 block only when FP8), and the generation config and tokenizer files: --like's, or else
    those convert stored in the torch_dist checkpoint; glmconv.json records what FP8 encoding did."""
    write_new(stage / CONFIG_NAME, json.dumps(job.config_json, indent=2) + "\n")
    for name, path in job.sidecars.items():
        copy_new(path, stage / name)
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
    report = audit_mod.audit(stage, against=job.src, accept_flat_prefix=True, config=job.config_path)
    objects = set(job.plan.mcore_objects())  # a trainer needs them; export reads no object, so it does not
    liked = {t.name for key in job.from_like for t in job.plan.mapping_of_key[key].mcore}  # SRC lacks them
    audit_mod.refuse(stage, [f for f in report.findings if not _is_padding(job, f) and
                             not (f.side == "against" and f.tensor in objects | liked)])


def _is_padding(job: ExportJob, f: audit_mod.Finding) -> bool:
    """The audit sees a padded vocabulary as a shape mismatch on the source; export stripped it on purpose."""
    spec = job.plan.mcore_index.get(f.tensor)
    rows = job.stored_rows.get(f.tensor)
    return f.side == "against" and f.kind == "shape" and spec is not None and rows is not None and \
        f.found == str([rows, *spec.shape[1:]])


# ---- running: one process, --workers N, or torchrun ranks ---------------------------------------------

def bytes_in(job: ExportJob) -> int:
    """Bytes of Megatron tensor data export reads."""
    return sum(m.mcore_bytes for m in job.plan.mappings)


def fp8_work_bytes(job: ExportJob) -> int:
    """Megatron bytes that FP8 encoding goes through (`--fp8`): what `--workers auto` weighs as convert weighs
    dequantisation."""
    return sum(m.mcore_bytes for m in job.plan.mappings if any(job.dtypes.get(t.name) == FP8 for t in m.hf))


def bytes_out(job: ExportJob) -> int:
    """Bytes of HF tensor data export writes (each tensor in the dtype it is written as, FP8 scales included)."""
    return sum(t.nbytes for m in job.plan.mappings for t in planned_outputs(m, job.dtypes, DEFAULT_CHUNK_BYTES))


def space_plan(job: ExportJob, check: bool) -> dict[str, Any]:
    """Estimated time and the free space at OUT (glmconv/space.py); `check`: refuse an output that cannot fit."""
    from glmconv import space

    return space.plan(job.out, bytes_in(job), bytes_out(job), fp8=job.plan.fp8, check=check)


def dry_run_summary(job: ExportJob, opts: ExportOptions) -> dict[str, Any]:
    """What export would do: tensors, bytes in and out, the estimated time and the free space at OUT (refused,
    as a real run would be, when it cannot fit unless `opts.space_check` is off)."""
    plan = job.plan
    return {"src": str(job.src), "out": str(job.out), "iteration": job.iteration, "fp8": plan.fp8, "mtp": plan.mtp,
            "vision": plan.vision, "layout": plan.layout, "text_prefix": plan.text_prefix,
            "like": str(job.like) if job.like else None,
            "hf_tensors": len(plan.hf_index), "mcore_tensors": len(plan.mcore_index), "bytes_in": bytes_in(job),
            "bytes_out": bytes_out(job), "workers": opts.workers, **shards_from(job), **origins(job),
            **_from_like(job),
            **space_plan(job, opts.space_check)}


def check_loadable(src: Path) -> None:
    """Every stored object of `src` (each `_extra_state`, the common state) loads as a trainer's torch.load would:
    a run checks it before any work (a dry run does not: it imports no torch)."""
    from glmconv.io.torch_dist.stored_objects import check_stored_objects

    ck = inspect_torch_dist(src)
    check_stored_objects(ck.iter_dir, ck.objects)


def export(job: ExportJob, opts: ExportOptions, *, force: bool = False) -> dict[str, Any]:
    """Run the export; returns the summary rank 0 publishes. Raises GlmconvError on any failure."""
    start = time.monotonic()
    check_loadable(job.src)
    inputs = _inputs(job.src, job.like, job.config_path)

    summary = publish_run(ExportRun(job, opts), job.out, inputs, force, opts.workers,
                          (lambda: space_plan(job, True)) if opts.space_check else None)
    return {**summary, "elapsed_s": round(time.monotonic() - start, 3)}


class ExportRun(PlanRun[ShareResult]):
    """Export's steps of the shared flow: each rank writes shards into its own folder; rank 0 names them."""

    verb = "export"
    noun = "HF tensors"

    def __init__(self, job: ExportJob, opts: ExportOptions) -> None:
        self.job, self.opts, self.show_progress = job, opts, opts.progress

    def share_of(self, rank: int, world: int) -> list[Mapping]:
        order = {id(m): i for i, m in enumerate(self.job.plan.mappings)}
        split = shares(self.job.plan.mappings, world) if self.job.like_files is None else file_shares(self.job, world)
        return sorted(split[rank], key=lambda m: order[id(m)])

    def share_bytes(self, share: list[Mapping]) -> int:
        return sum(t.nbytes for m in share for t in planned_outputs(m, self.job.dtypes, self.opts.chunk_bytes))

    def share_items(self, share: list[Mapping]) -> int:
        return sum(len(planned_outputs(m, self.job.dtypes, self.opts.chunk_bytes)) for m in share)

    def run_share(self, share: list[Mapping], rank: int, stage: Path, prog: Progress, group: Group) -> ShareResult:
        o = self.opts
        return run_share(self.job, share, rank, stage, prog, o.chunk_bytes, o.check_finite, o.zero_copy, o.threads,
                         o.ahead_bytes)

    def check(self, results: list[ShareResult]) -> None:
        """Every Megatron tensor consumed once and every HF tensor written once, across all ranks."""
        check_once((n for r in results for n in r.consumed), self.job.plan.mcore_index, "consumed")
        check_once((n for r in results for n in r.weight_map), self.job.plan.hf_index, "written")

    def finish(self, stage: Path, results: list[ShareResult], world: int) -> JsonObject:
        try:
            shards, total = merge_shards(stage, results, self.job.like_files)
            write_sidecars(self.job, stage, fp8_stats(results))
            verify_staged(self.job, stage)
        except OSError as exc:
            raise CheckpointError(f"{self.job.out}: cannot write the export ({exc.strerror or exc})") from None
        return summary(self.job, results, shards, total, world)


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
            "published": str(job.out)}



def shards_from(job: ExportJob) -> dict[str, Any]:
    """How the shards are cut: as --like's files, or at `max_shard_bytes` (and why not as --like's, if it was given
    without --max-shard-size)."""
    return {"shards_from": LIKE if job.like_files is not None else "max_shard_bytes",
            "max_shard_bytes": None if job.like_files is not None else job.max_shard_bytes,
            "like_files_unfit": job.like_files_unfit}


def _from_like(job: ExportJob) -> dict[str, Any]:
    return from_like_summary(job.plan, job.from_like, job.src, job.like)


def from_like_summary(plan: Plan, from_like: frozenset[tuple[str, ...]], src: Path,
                      like: Path | None) -> dict[str, Any]:
    """HF tensors SRC had none of (homeless in its layout), taken unchanged from --like, and a line saying so
    (export, relayout)."""
    taken = sorted(t.name for key in from_like for t in plan.mapping_of_key[key].hf)
    warning = (f"warning: {count(len(taken), 'HF tensor')} that the {plan.layout} layout has no trainer parameter "
               f"for ({', '.join(sorted({plan.mapping_of_key[k].rule.role for k in from_like}))}) are not in "
               f"{src}: taken unchanged from --like {like}") if taken else None
    return {"taken_from_like": taken, "taken_from_like_warning": warning}


def fp8_stats(results: list[ShareResult]) -> Fp8Stats:
    """Every rank's FP8 counts, summed."""
    fp8 = Fp8Stats()
    for r in results:
        fp8.add(r.fp8)
    return fp8
