"""An export decided before a byte of tensor data is read: the source torch_dist checkpoint checked against its plan
(shapes, dtypes, stored args, padded vocabulary), the dtypes and sidecars to write, and what comes from --like.
export, relayout, verify and the weight-sync API all start from `source_job`."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv import source_dtypes
from glmconv.checkpoint_layout import checkpoint_layout
from glmconv.config import GlmConfig
from glmconv.defaults import DEFAULT_SHARD_BYTES
from glmconv.errors import CheckpointError, ConfigError
from glmconv.io import sidecars
from glmconv.io.checkpoint_files import optional_file
from glmconv.io.config_file import load_config
from glmconv.io.file_names import (
    COMMON_PT_NAME,
    COMMON_STATE_KEY,
    CONFIG_NAME,
    DCP_METADATA_NAME,
    MANIFEST_NAME,
)
from glmconv.io.jsonfile import load_json_file
from glmconv.io.safetensors.checkpoint import HfCheckpoint, inspect_hf_checkpoint
from glmconv.io.safetensors.like_files import LikeFiles
from glmconv.io.safetensors.reader import HfTensorSource
from glmconv.io.torch_dist.common_state import read_common_state
from glmconv.io.torch_dist.loadable import check_stored_objects
from glmconv.io.torch_dist.metadata import DcpCheckpoint, inspect_torch_dist
from glmconv.io.torch_dist.metadata import config_path as mcore_config_path
from glmconv.megatron_args import check_stored_args
from glmconv.numerics.fp8 import FP8_BLOCK, check_block_size
from glmconv.plan import Mapping, Plan, TensorSpec, build_plan, retyped
from glmconv.release_config import modules_not_converted, quantization_config
from glmconv.rules import names
from glmconv.runners import audit as audit_mod
from glmconv.runners.backward import Read
from glmconv.runners.job import PlanJob
from glmconv.text import count

if TYPE_CHECKING:
    import torch


VOCAB_DIM = "vocab"

LIKE, CONVERTED, PLAN = "--like", "converted checkpoint", "plan"  # where dtypes and sidecars come from


@dataclass
class ExportJob(PlanJob):
    """Everything decided before a byte of tensor data is read (sidecars: --like's files, else convert's record)."""

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
    dtypes_from: str = PLAN  # LIKE, CONVERTED (glmconv.json's record) or PLAN (an older glmconv's checkpoint)
    sidecars_from: str | None = None  # LIKE, CONVERTED or None
    from_like: frozenset[tuple[str, ...]] = frozenset()  # keys of homeless mappings SRC lacks, taken from --like
    source: DcpCheckpoint | None = None  # SRC as inspected (metadata read and checked): read once per run
    like_source: HfCheckpoint | None = None  # --like as inspected (its headers): read once per run


def source_job(src: str | Path, *, like: str | Path | None = None, config: str | Path | None = None,
               fp8: bool = False, layout: str | None = None, config_option: str | None = "--config") -> ExportJob:
    """What export would write from `src`, decided and checked (plan, stored args, shapes, dtypes), with no output:
    `prepare` and the weight-sync API (`glmconv.weight_sync`) both start here.

    `layout`: the Megatron layout to read `src` in; None: the one glmconv.json records, else the one its names
    are spelled in (glmconv.checkpoint_layout). Tensors kept under glmconv_kept. are exported like any other;
    where SRC has none (its trainer, with no parameter for them, saved none), they come unchanged from --like.
    `config_option`: the caller's option naming a config.json, offered when `src` has none (None: no option)."""

    src_p = Path(src)
    ck = inspect_torch_dist(src_p)
    if ck.common_state is None:
        raise CheckpointError(f"{ck.iter_dir}: common state missing: no {COMMON_PT_NAME} and no {COMMON_STATE_KEY} "
                              f"entry in {DCP_METADATA_NAME} (a Megatron checkpoint always has one)")
    common = read_common_state(ck.iter_dir, ck.metadata)
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
        src=src_p, out=src_p, plan=plan,
        config_json=_config_json(like_ck.config if like_ck else cfg, plan, like_ck.path if like_ck else cfg_path),
        dtypes=dtypes, stored_rows=stored_rows, iteration=str(common.get("iteration", ck.iteration)),
        like=Path(like) if like is not None else None, config_path=Path(config) if config is not None else None,
        source_text_prefix=manifest.get("text_prefix"), source_fp8=manifest.get("fp8_source"),
        sidecars=files, dtypes_from=dtypes_from, sidecars_from=files_from, from_like=from_like, source=ck,
        like_source=like_ck)


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


def read_manifest(src: Path) -> dict[str, Any]:
    """The source's glmconv.json as a dict ({} without one): what convert recorded, which anyone may have edited."""
    path = optional_file(src, MANIFEST_NAME)
    data = load_json_file(path, source=str(src / MANIFEST_NAME)) if path is not None else {}
    return data if isinstance(data, dict) else {}


def _manifest(src: Path) -> dict[str, Any]:
    """The records export uses, of the types convert writes; the dtype record and the sidecar list are checked
    where they are used."""
    data = read_manifest(src)
    types = {"text_prefix": str, "fp8_source": bool}
    out = {k: data[k] for k, kind in types.items() if type(data.get(k)) is kind}
    return {**out, **{k: data[k] for k in (source_dtypes.KEY, sidecars.KEY) if k in data}}


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


def _config_json(cfg: GlmConfig, plan: Plan, path: Path) -> dict[str, Any]:
    """The config to publish: FP8 quantization_config exactly when the tensors are FP8, its block size refused
    (naming `path`, the config it comes from) where it does not describe the scales written."""

    raw = cfg.to_json()
    q = raw.pop("quantization_config", None)
    if plan.fp8:
        fp8_q = isinstance(q, dict) and q.get("quant_method") == "fp8"
        raw["quantization_config"] = q if fp8_q else quantization_config(modules_not_converted(raw))
        scales = [(s.name, s.shape, t.shape) for m in plan.mappings for t, s in zip(m.hf, m.scales) if s is not None]
        try:
            check_block_size(raw, scales)
        except ConfigError as exc:
            raise ConfigError(f"{path / CONFIG_NAME if path.is_dir() else path}: {exc}; export --fp8 writes "
                              f"{FP8_BLOCK}x{FP8_BLOCK} blocks") from None
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


def like_tensors(like: HfCheckpoint | None, share: list[Mapping],
                 from_like: frozenset[tuple[str, ...]]) -> AbstractContextManager[HfTensorSource | None]:
    """--like's tensors (`like` as inspected), open while this share makes the mappings SRC lacks (export,
    relayout); None when it has none of them."""

    if like is None or not any(m.key in from_like for m in share):
        return nullcontext(None)
    return HfTensorSource(like.tensor_files(), headers=like.headers)


def check_loadable(src: Path, ck: DcpCheckpoint | None = None) -> None:
    """Every stored object of `src` (each `_extra_state`, the common state) loads as a trainer's torch.load would:
    a run checks it before any work (a dry run does not: it imports no torch). `ck`: `src` already inspected."""

    ck = ck if ck is not None else inspect_torch_dist(src)
    check_stored_objects(ck.iter_dir, ck.objects, ck.metadata)


def from_like_summary(plan: Plan, from_like: frozenset[tuple[str, ...]], src: Path,
                      like: Path | None) -> dict[str, Any]:
    """HF tensors SRC had none of (homeless in its layout), taken unchanged from --like, and a line saying so
    (export, relayout)."""
    taken = sorted(t.name for key in from_like for t in plan.mapping_of_key[key].hf)
    warning = (f"warning: {count(len(taken), 'HF tensor')} that the {plan.layout} layout has no trainer parameter "
               f"for ({', '.join(sorted({plan.mapping_of_key[k].rule.role for k in from_like}))}) are not in "
               f"{src}: taken unchanged from --like {like}") if taken else None
    return {"taken_from_like": taken, "taken_from_like_warning": warning}


def is_stripped_padding(job: ExportJob, f: audit_mod.Finding) -> bool:
    """The audit sees a padded vocabulary as a shape mismatch on the source; export strips it on purpose."""
    spec, rows = job.plan.mcore_index.get(f.tensor), job.stored_rows.get(f.tensor)
    return spec is not None and rows is not None and f.is_stored_shape([rows, *spec.shape[1:]])

