"""torch_dist -> torch_dist between the Megatron layouts (miles <-> mcore): the plan run backward then forward.

Each mapping of the target layout's plan is paired, by its layout-independent identity (`Mapping.key`), with the
source layout's mapping; the target tensors are what the target transform makes of the HF tensors the source
transform gives back. Where both transforms only move bytes, the two byte layouts are composed -- target bytes
as pieces of HF bytes (`forward_layout`), HF bytes as pieces of source Megatron bytes (`backward_layout`) -- and
the pieces located in the source's `.distcp` files (`DcpReader.byte_extents`): the target tensors are
`FileTensor`s, copied file to file by the kernel, never read. Otherwise (an item the reader cannot locate, or
`GLMCONV_ZERO_COPY=0`) the source tensors are read through torch.load, `backward` then `forward`; stacked experts
go a few rows at a time either way. Nothing is ever cast: each target tensor keeps its source's dtype, so export
of the output equals export of the source bit for bit.

The output is a complete torch_dist checkpoint as convert writes one (DCP data files through `DcpWriter`, the
`_extra_state` objects the target plan asks for, the common state), with the source's `args` and iteration kept
(the target layout's `glmconv` entry and `mtp_num_layers` rule applied), config.json, and glmconv.json carrying
the source's records export needs (HF dtypes, sidecar files with their sha256, text prefix, FP8 source).
Relayout to the layout the source already has is refused (a plain `cp -r` does that). A vocabulary a trainer
padded keeps its padding. Optimizer state in the source is not carried (counted in the summary).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import source_dtypes, space
from glmconv.defaults import DEFAULT_GROUP_BYTES, KEEP, zero_copy
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io import finite, sidecars
from glmconv.io.byte_copy import Extent
from glmconv.io.dtypes import torch_dtype
from glmconv.io.file_names import CONFIG_NAME, MANIFEST_NAME
from glmconv.io.jsonfile import JsonObject
from glmconv.io.output import check_overlap, manifest_fields, write_new
from glmconv.io.safetensors.checkpoint import HfCheckpoint
from glmconv.io.safetensors.reader import HfTensorSource
from glmconv.io.torch_dist.byte_route import piece_spans, route_extents
from glmconv.io.torch_dist.common_state import read_common_state
from glmconv.io.torch_dist.metadata import inspect_torch_dist
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.io.torch_dist.torch_save import FileTensor
from glmconv.io.torch_dist.writer import Chunk, DcpWriter, empty_extra_state
from glmconv.megatron_args import relaid_common_state
from glmconv.mistakes import expect_torch_dist
from glmconv.plan import Mapping, Plan, TensorSpec, build_plan, retyped
from glmconv.progress import Progress
from glmconv.rules import layouts, names
from glmconv.rules.ops import Rename
from glmconv.rules.pieces import Piece, take
from glmconv.rules.table import F32
from glmconv.runners import audit as audit_mod
from glmconv.runners.convert import layout_summary
from glmconv.runners.export_job import (
    ExportJob,
    check_loadable,
    from_hf,
    from_like_summary,
    like_tensors,
    read_manifest,
    source_job,
)
from glmconv.runners.flow import FlowOptions, WritesMegatron, check_once, publish_run
from glmconv.runners.job import Job
from glmconv.runners.ranks import Group

if TYPE_CHECKING:
    import torch


CARRIED = ("fp8_source", "mtp", "vision", "text_prefix", "hf_tensors", "left_out", "dtype", "narrowed_f32_to_bf16",
           "widened_bf16_to_f32")  # glmconv.json records of the source kept as they are (with the dtype record)


@dataclass
class RelayoutJob(Job):
    """Everything decided before a byte of tensor data is read (sidecars: the HF files the source stores, sha256
    checked)."""

    source: Plan  # the source's plan, in its layout, with the dtypes and (padded) shapes it holds
    target: Plan  # the same mappings in the target layout, same dtypes and shapes
    common: dict[str, Any]  # the source's common state (its args, iteration), made the target layout's
    manifest: dict[str, Any]  # the source's glmconv.json ({} without one)
    padded: dict[str, int] = field(default_factory=dict)  # vocab-padded tensors: rows on disk (kept)
    training_state: int = 0  # optimizer tensors in the source, not carried
    like: Path | None = None  # --like: where the homeless tensors a trainer's checkpoint lacks come from
    like_source: HfCheckpoint | None = None  # --like as inspected
    from_like: frozenset[tuple[str, ...]] = frozenset()  # keys of those mappings

    @property
    def pairs(self) -> list[tuple[Mapping, Mapping]]:
        """(source mapping, target mapping) per mapping, in the target plan's order."""
        return [(self.source.mapping_of_key[m.key], m) for m in self.target.mappings]

    @property
    def bytes_in(self) -> int:
        return self.source.mcore_bytes

    @property
    def bytes_out(self) -> int:
        return self.target.mcore_bytes


@dataclass(frozen=True)
class RelayoutOptions(FlowOptions):
    """How relayout runs: memory per group, and whether bytes may move unread."""

    group_bytes: int = DEFAULT_GROUP_BYTES
    zero_copy: bool = field(default_factory=zero_copy)  # GLMCONV_ZERO_COPY=0: always read through torch


# ---- deciding the plan -------------------------------------------------------------------------------

def prepare(src: str | Path, out: str | Path, *, to: str, like: str | Path | None = None) -> RelayoutJob:
    """Check the source torch_dist checkpoint as export does (its plan, stored args, shapes, dtypes, recorded
    sidecars) and pair its mappings with the `to` layout's; the same layout is refused.

    `like`: the HF checkpoint training started from, for a source saved by a trainer that has no parameter for
    some tensors (the mcore layout's kpool compression): those are made from its, as convert would make them."""

    layouts.layout(to)  # an unknown layout: one line, before anything is read
    src_p = Path(src)
    expect_torch_dist(src_p, "relayout")  # an HF directory: convert was meant
    check_overlap(Path(out), {"input": src_p, "--like directory": Path(like) if like is not None else None})
    job = source_job(src_p, like=like, config_option=None)
    if job.plan.layout == to:
        raise GlmconvError(f"{src_p}: already in the {to} layout; relayout --to {to} would only copy it "
                           f"(cp -r does that)")
    ck = job.source
    assert ck is not None  # source_job inspected it
    rows = {job.plan.mapping_of_mcore[n].key: ck.tensors[n].shape for n in job.stored_rows}
    source = _padded(_stored_like(job), rows)
    plan = build_plan(source.config, mtp=source.mtp, vision=source.vision, text_prefix=source.text_prefix,
                      layout=to)
    target = _padded(_like_source(plan, source), rows)
    common = relaid_common_state(read_common_state(ck.iter_dir, ck.metadata), target.config, to)  # refused now
    return RelayoutJob(src=src_p, out=Path(out), source=source, target=target, common=common,
                       manifest=read_manifest(src_p), sidecars=job.sidecars, padded=dict(job.stored_rows),
                       training_state=sum(names.is_training_state(n) for n in ck.tensors), like=job.like,
                       like_source=job.like_source, from_like=job.from_like)


def _stored_like(job: ExportJob) -> Plan:
    """The export job's plan with the Megatron dtypes of the mappings the source lacks set as convert would set
    them from --like's stored dtypes (`keep`): nothing is rounded on the way to the target."""
    if not job.from_like:
        return job.plan

    assert job.like_source is not None  # tensors come from --like only when it is given
    stored = {n: t.dtype for n, t in job.like_source.tensors.items()}
    dtypes = {}
    for key in job.from_like:
        m = job.plan.mapping_of_key[key]
        dtype = m.rule.dtypes.megatron_dtype(KEEP, [stored[t.name] for t in m.hf])
        dtypes.update({t.name: dtype for t in m.mcore})
    return retyped(job.plan, dtypes)


def _like_source(target: Plan, source: Plan) -> Plan:
    """`target` with each mapping's Megatron dtype the source's (one per mapping; F32, the wider, where the
    source's tensors of one mapping differ: nothing is ever rounded)."""
    dtypes: dict[str, str] = {}
    for m in target.mappings:
        found = {t.dtype for t in source.mapping_of_key[m.key].mcore}
        dtype = found.pop() if len(found) == 1 else F32
        dtypes.update({t.name: dtype for t in m.mcore})
    return retyped(target, dtypes)


def _padded(plan: Plan, rows: dict[tuple[str, ...], tuple[int, ...]]) -> Plan:
    """`plan` with the vocabulary rows a trainer padded (`rows`: stored shape by mapping key): HF and Megatron
    shapes as stored, so the padding moves with the tensor (only renamed tensors are ever padded: the embedding
    and the output layer)."""
    maps = []
    for m in plan.mappings:
        stored = rows.get(m.key)
        if stored is not None:
            if not isinstance(m.rule.transform, Rename) or len(m.hf) != 1 or len(m.mcore) != 1:
                raise CheckpointError(f"{m.mcore[0].name}: padded rows on a tensor that is not only renamed")
            m = dataclasses.replace(m, hf=(dataclasses.replace(m.hf[0], shape=stored),),
                                    mcore=(dataclasses.replace(m.mcore[0], shape=stored),))
        maps.append(m)
    return dataclasses.replace(plan, mappings=maps) if rows else plan


# ---- making the target tensors -----------------------------------------------------------------------

def composed_layout(src_m: Mapping, tgt_m: Mapping) -> list[list[Piece]] | None:
    """Each target tensor's bytes as pieces of the source Megatron tensors' bytes, where both transforms only
    move bytes in one dtype; None otherwise."""
    dtype = src_m.mcore[0].dtype
    if any(t.dtype != dtype for t in (*src_m.mcore, *tgt_m.mcore)):
        return None
    back = src_m.byte_layout([dtype] * len(src_m.hf), backward=True)  # HF i as pieces of source tensors
    fwd = tgt_m.byte_layout([dtype] * len(tgt_m.hf))  # target j as pieces of HF tensors
    if back is None or fwd is None or len(back) != len(src_m.hf):
        return None
    out = [[q for p in pieces for q in take(back[p.source], p.offset, p.offset + p.length)] for pieces in fwd]
    if [sum(p.length for p in pieces) for pieces in out] != [t.nbytes for t in tgt_m.mcore]:
        return None
    return out


def _located(src_m: Mapping, reader: DcpReader) -> bool:
    return all(reader.locatable(t.name) for t in src_m.mcore)


def _extents(src_m: Mapping, reader: DcpReader, pieces: list[Piece]) -> list[Extent]:
    return route_extents(reader, piece_spans(pieces, [t.name for t in src_m.mcore]))


def _file_tensor(spec: TensorSpec, shape: tuple[int, ...], extents: list[Extent], row0: int = 0) -> FileTensor:
    """Rows [row0, row0 + shape[0]) of `spec` as the bytes `extents`, scanned for NaN/Inf as they are copied."""
    import torch

    where = str(extents[0].path.parent) if extents else spec.name
    finite.require_finite_extents(extents, torch_dtype(spec.dtype), tuple(shape), spec.name, where, row0)
    return FileTensor(torch.Size(shape), torch_dtype(spec.dtype), tuple(extents))


@dataclass
class Counts:
    """What the share did: source tensors consumed, mappings copied file to file or computed, bytes copied."""

    consumed: list[str] = field(default_factory=list)
    copied_mappings: int = 0
    computed_mappings: int = 0
    bytes_copied: int = 0
    bytes_read: int = 0  # source bytes read through torch.load


def pair_chunks(src_m: Mapping, tgt_m: Mapping, reader: DcpReader, chunk_bytes: int, zero_copy: bool,
                counts: Counts, like_src: HfTensorSource | None = None) -> Iterator[Chunk]:
    """The target tensors of one mapping, as `DcpWriter` chunks; stacked experts `chunk_bytes` at a time. With
    `like_src`, the source lacks the mapping: it is made from those HF tensors."""

    read = from_hf(src_m, like_src) if like_src is not None else reader.read
    layout = composed_layout(src_m, tgt_m) if zero_copy and like_src is None and _located(src_m, reader) else None
    steps = tgt_m.row_steps(chunk_bytes)
    if layout is not None:
        counts.copied_mappings += 1
        counts.bytes_copied += tgt_m.mcore_bytes
        if steps is None:
            for spec, pieces in zip(tgt_m.mcore, layout):
                yield Chunk(spec.name, _file_tensor(spec, spec.shape, _extents(src_m, reader, pieces)))
        else:
            spec = tgt_m.mcore[0]
            row_bytes = spec.nbytes // spec.shape[0]
            for rows, _ in steps:
                pieces = take(layout[0], rows.start * row_bytes, rows.stop * row_bytes)
                copied = _file_tensor(spec, (len(rows), *spec.shape[1:]), _extents(src_m, reader, pieces), rows.start)
                yield Chunk(spec.name, copied, row=rows.start, shape=spec.shape)
    else:
        counts.computed_mappings += 1
        try:
            if steps is not None and src_m.by_rows:
                for rows, picks in steps:
                    (chunk,) = _computed(src_m, tgt_m, read, picks, (rows.start, rows.stop))
                    yield Chunk(tgt_m.mcore[0].name, chunk, row=rows.start, shape=tgt_m.mcore[0].shape)
            else:
                for spec, tensor in zip(tgt_m.mcore, _computed(src_m, tgt_m, read, range(len(src_m.hf)), None)):
                    yield Chunk(spec.name, tensor)
        finally:
            reader.drop_cache()
    counts.consumed.extend(t.name for t in src_m.mcore)


def _computed(src_m: Mapping, tgt_m: Mapping, read: Callable[[str, tuple[int, int] | None], torch.Tensor],
              picks: list[int] | range, rows: tuple[int, int] | None) -> list[torch.Tensor]:
    """Source tensors (rows `rows` of a stacked one) read, `backward` to the HF tensors `picks`, `forward` to the
    target's; each in the target's dtype (the source's: nothing is rounded)."""

    mc = [read(t.name, rows) for t in src_m.mcore]
    hf = src_m.rule.transform.backward(mc, [src_m.hf[i].shape for i in picks])
    out = tgt_m.rule.transform.forward(hf, len(tgt_m.mcore))
    return [t.to(torch_dtype(spec.dtype)).contiguous() for t, spec in zip(out, tgt_m.mcore)]


# ---- sidecars and verification -----------------------------------------------------------------------

def write_sidecars(job: RelayoutJob, stage: Path) -> None:
    """config.json, the source's HF sidecar files (sha256 checked when the job was prepared), and glmconv.json:
    the source's records export needs, the target layout and what it has no home for."""

    write_new(stage / CONFIG_NAME, json.dumps(job.target.config.to_json(), indent=2) + "\n")
    hashes = sidecars.store(job.sidecars, stage)
    src = job.manifest
    carried = {k: src[k] for k in CARRIED if k in src}
    records = {k: src[k] for k in (source_dtypes.KEY,) if k in src}
    manifest = {**manifest_fields(), "source": str(job.src.resolve()), "converted_from": src.get("source"),
                **carried, "mtp": job.target.mtp, "vision": job.target.vision,
                "relayout_from": job.source.layout, **layout_summary(job.target),
                "mcore_tensors": len(job.target.mcore_index), "bytes_in": job.bytes_in, "bytes_out": job.bytes_out,
                **records, sidecars.KEY: hashes}
    write_new(stage / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")


def verify_staged(job: RelayoutJob, stage: Path) -> None:
    """Re-read what was written (DCP metadata, glmconv.json) and audit it against the source through the mapping,
    both ways: names of the target layout, shapes, dtypes, the `_extra_state` objects, the config, the layout
    record. A padded vocabulary is kept on purpose (the audit plans it unpadded)."""

    findings = audit_mod.output_findings(job.src, stage, audit_mod.Options(layout=job.source.layout),
                                         audit_mod.Options(layout=job.target.layout))
    lacked = {t.name for key in job.from_like for t in job.source.mapping_of_key[key].mcore}  # made from --like
    audit_mod.refuse(stage, [f for f in findings if not _is_padding(job, f) and
                             not (f.side == "src" and f.tensor in lacked)])
    written = {n: (t.shape, t.dtype) for n, t in inspect_torch_dist(stage).tensors.items()
               if not names.is_training_state(n)}
    want = {n: (t.shape, t.dtype) for n, t in job.target.mcore_index.items()}
    if written != want:
        bad = sorted(n for n in set(written) | set(want) if written.get(n) != want.get(n))[0]
        raise CheckpointError(f"verification of {stage} failed: {bad}: written {written.get(bad)}, planned "
                              f"{want.get(bad)}")


def _is_padding(job: RelayoutJob, f: audit_mod.Finding) -> bool:
    """A padded vocabulary, kept as stored: the audit sees its shape differ from the plan's."""
    spec = job.target.mcore_index.get(f.tensor)
    return spec is not None and f.tensor in job.padded and f.is_stored_shape(spec.shape)


# ---- running -----------------------------------------------------------------------------------------

def space_plan(job: RelayoutJob, check: bool) -> dict[str, Any]:
    return space.plan(job.out, job.bytes_in, job.bytes_out, fp8=False, check=check)


def plan_summary(job: RelayoutJob) -> dict[str, Any]:
    t = job.target
    return {"src": str(job.src), "out": str(job.out), "from": job.source.layout, "to": t.layout,
            "iteration": job.common.get("iteration"), "mtp": t.mtp, "vision": t.vision,
            **layout_summary(t), "mcore_tensors_in": len(job.source.mcore_index),
            "mcore_tensors": len(t.mcore_index), "mappings": len(t.mappings), "bytes_in": job.bytes_in,
            "bytes_out": job.bytes_out, "vocab_padding_kept": dict(sorted(job.padded.items())),
            "training_state_dropped": job.training_state, "sidecars": sorted(job.sidecars),
            **from_like_summary(job.source, job.from_like, job.src, job.like)}


def dry_run_summary(job: RelayoutJob, opts: RelayoutOptions) -> dict[str, Any]:
    """What relayout would do: tensors and bytes on both sides, the estimated time and the free space at OUT
    (refused, as a real run would be, when it cannot fit unless `opts.space_check` is off)."""
    return {**plan_summary(job), **space_plan(job, opts.space_check)}


def relayout(job: RelayoutJob, opts: RelayoutOptions, *, force: bool = False) -> dict[str, Any]:
    """Run the relayout; returns the summary. Raises GlmconvError on any failure."""

    check_loadable(job.src)
    return publish_run(RelayoutRun(job, opts), job.out, {"input": job.src}, force, 1,
                       (lambda: space_plan(job, True)) if opts.space_check else None)


class RelayoutRun(WritesMegatron[Counts]):
    """Relayout's steps of the shared flow (one rank): DCP data files, then objects, common state, metadata."""

    verb = "relayout"

    def __init__(self, job: RelayoutJob, opts: RelayoutOptions) -> None:
        self.job, self.opts, self.show_progress = job, opts, opts.progress
        self._writer: DcpWriter | None = None

    def share_of(self, rank: int, world: int) -> list[Mapping]:
        return list(self.job.target.mappings)

    def run_share(self, share: list[Mapping], rank: int, stage: Path, prog: Progress, group: Group) -> Counts:
        writer = self._writer = DcpWriter(stage, specs=self.job.target.mcore_index, group=group, progress=prog,
                                          kept=names.is_kept)
        reader = DcpReader(self.job.src)
        counts = Counts()
        pairs = {m.key: src for src, m in self.job.pairs}

        def chunks(like_src: HfTensorSource | None) -> Iterator[Chunk]:
            for m in share:
                yield from pair_chunks(pairs[m.key], m, reader, self.opts.chunk_bytes, self.opts.zero_copy, counts,
                                       like_src if m.key in self.job.from_like else None)

        with like_tensors(self.job.like_source, share, self.job.from_like) as like_src:
            writer.write_stream(chunks(like_src), self.opts.group_bytes)
        counts.bytes_read = reader.bytes_read
        return counts

    def check(self, results: list[Counts]) -> None:
        check_once((n for r in results for n in r.consumed), self.job.source.mcore_index, "consumed")

    def after_check(self, rank: int, stage: Path, group: Group) -> None:
        """The `_extra_state` objects the target plan asks for, then DCP's metadata and the common state."""

        assert self._writer is not None  # run_share made it
        self._writer.write_objects({key: empty_extra_state() for key in self.job.target.mcore_objects()})
        self._writer.finish(self.job.common)

    def finish(self, stage: Path, results: list[Counts], world: int) -> JsonObject:
        write_sidecars(self.job, stage)
        verify_staged(self.job, stage)
        c = results[0]
        return {**plan_summary(self.job), "copied_mappings": c.copied_mappings,
                "computed_mappings": c.computed_mappings, "bytes_copied": c.bytes_copied,
                "bytes_read": c.bytes_read, "published": str(self.job.out)}
