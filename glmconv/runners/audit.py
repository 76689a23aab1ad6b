"""Audit a checkpoint (HF or torch_dist) or a config against the plan, and two of them against each other.

Every finding names a tensor: what the plan expects and what is on disk. torch is imported only when a
torch_dist checkpoint is read.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmconv.checkpoint_layout import recorded_layout
from glmconv.config import GlmConfig
from glmconv.defaults import DEFAULT_LAYOUT
from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import check_checkpoint_dir
from glmconv.io.config_file import load_config
from glmconv.io.file_names import CONFIG_NAME, MANIFEST_NAME
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint, is_hf_checkpoint
from glmconv.io.torch_dist.metadata import (
    DcpCheckpoint,
    config_path,
    inspect_torch_dist,
    is_torch_dist,
    resolve_iter_dir,
)
from glmconv.plan import FP8, Mapping, Plan, TensorSpec, build_plan, detect_layout, dims
from glmconv.rules import names
from glmconv.text import count

KINDS = ("missing", "unexpected", "duplicate", "shape", "dtype", "fp8-scale-missing", "scale-shape", "orphan-scale",
         "prefix", "index", "config", "layout")
CONFIG, HF, MCORE = "config", "hf", "mcore"
Found = tuple[tuple[int, ...], str, str]  # shape, dtype, file


@dataclass(frozen=True)
class Finding:
    """One disagreement between the plan and what is on disk (or between SRC and --against)."""

    kind: str
    tensor: str
    file: str
    expected: str
    found: str
    side: str = "src"

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, "side": self.side, "tensor": self.tensor, "file": self.file,
                "expected": self.expected, "found": self.found}

    def is_stored_shape(self, shape: tuple[int, ...] | list[int]) -> bool:
        """A shape mismatch of the checkpoint audited against (`--against`) whose stored shape is `shape`: what
        export and relayout accept on purpose for a padded vocabulary."""
        return self.side == "against" and self.kind == "shape" and self.found == str(list(shape))


@dataclass(frozen=True)
class Options:
    """Plan options from the command line; None means "detect from the checkpoint"."""

    fp8: bool | None = None
    mtp: bool | None = None
    vision: bool | None = None
    layers: int | None = None
    accept_flat_prefix: bool = False
    config: str | Path | None = None  # config for torch_dist sides
    layout: str | None = None  # the Megatron layout of torch_dist sides (None: recorded, else from the names)


@dataclass
class Side:
    """One audited thing: its kind, config, tensors on disk (None for a bare config) and its plan."""

    path: Path
    kind: str
    config: GlmConfig
    tensors: dict[str, Found] | None
    findings: list[Finding] = field(default_factory=list)
    plan: Plan | None = None
    quantized: bool = False  # an HF config with an FP8 quantization_config
    text_prefix: str | None = None  # the HF text prefix most tensors use
    ignored: int = 0  # tensors of layers beyond --layers, left out of the audit
    objects: set[str] | None = None  # torch_dist: ShardedObject keys (e.g. `_extra_state`) on disk
    fp8_vote: bool | None = None  # HF: the majority of FP8-eligible weights is stored FP8 (see _looks_fp8)
    plans: dict[tuple[Any, ...], Plan] = field(default_factory=dict, repr=False)  # `plan_for`'s, by options

    def plan_for(self, **options: Any) -> Plan:
        """`build_plan` of this side's config with `options`, built once an audit: its plan, the FP8 vote's and the
        cross-check's are often one plan (per tensor: 5,448 of them on a 3 GB bench, three plans each)."""
        key = (id(self.config), *sorted(options.items()))
        if key not in self.plans:
            self.plans[key] = build_plan(self.config, **options)
        return self.plans[key]

    def expected(self) -> dict[str, TensorSpec]:
        assert self.plan is not None
        return self.plan.mcore_index if self.kind == MCORE else self.plan.hf_index

    def plan_options(self) -> dict[str, Any]:
        assert self.plan is not None
        return {"kind": self.kind, "fp8": self.plan.fp8, "mtp": self.plan.mtp, "vision": self.plan.vision,
                "text_prefix": self.plan.text_prefix, "layers": self.config.num_layers,
                "ignored_beyond_layers": self.ignored, "layout": self.plan.layout,
                "homeless": sum(len(m.mcore) for m in self.plan.homeless())}  # Megatron tensors kept, not loaded


@dataclass
class AuditReport:
    """All findings of one audit, plus what was compared."""

    src: str
    against: str | None
    tensors: int
    against_tensors: int | None
    findings: list[Finding]
    plans: dict[str, dict[str, Any]]

    @property
    def ok(self) -> bool:
        return not self.findings

    def counts(self) -> dict[str, int]:
        c = Counter(f.kind for f in self.findings)
        return {k: c[k] for k in KINDS if c[k]}

    def summary(self) -> str:
        if self.ok:
            n = self.tensors + (self.against_tensors or 0)
            return f"OK: {count(n, 'tensor')} {'matches' if n == 1 else 'match'} the plan"
        kinds = ", ".join(f"{n:,} {k}" for k, n in self.counts().items())
        return f"FAIL: {count(len(self.findings), 'finding')} ({kinds})"

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "src": self.src, "against": self.against, "tensors": self.tensors,
                "against_tensors": self.against_tensors, "plans": self.plans, "counts": self.counts(),
                "findings": [f.as_json() for f in self.findings]}


# ---- loading a side ----------------------------------------------------------------------------------

def detect_kind(path: Path) -> str:
    """config.json file, HF checkpoint dir, or torch_dist dir."""

    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_file():
        return CONFIG
    check_checkpoint_dir(path)
    if is_torch_dist(path):
        return MCORE
    if is_hf_checkpoint(path) or (path / CONFIG_NAME).is_file():
        return HF
    if not any(path.iterdir()):
        raise CheckpointError(f"{path}: empty directory")
    raise CheckpointError(f"{path}: neither a config.json, an HF checkpoint nor a torch_dist checkpoint")


def load_side(path: str | Path, opts: Options, side: str = "src", inspected: DcpCheckpoint | None = None) -> Side:
    """Read what is on disk (headers and metadata only) for one side of the audit (`inspected`: a torch_dist
    `path` as `inspect_torch_dist` already read it in this run: its `.metadata` not unpickled again)."""
    p = Path(path)
    kind = detect_kind(p)
    if kind == CONFIG:
        s = Side(p, CONFIG, load_config(p), None)
    elif kind == HF:
        ck = inspect_hf_checkpoint(p, strict=False)
        tensors = {n: (t.shape, t.dtype, t.file) for n, t in ck.tensors.items()}
        findings = [Finding(pr.kind, pr.tensor, pr.file, pr.expected, pr.found, side) for pr in ck.problems]
        s = Side(p, HF, ck.config, tensors, findings, quantized=ck.quantized, text_prefix=ck.text_prefix)
    else:
        s = _load_mcore(p, opts, side, inspected)
    return _apply_layers(s, opts)


def _apply_layers(s: Side, opts: Options) -> Side:
    """--layers N: cut the config; on a deeper checkpoint only its first N decoder layers are audited (no MTP)."""
    if opts.layers is None:
        return s
    full = s.config.num_layers
    s.config = s.config.cut(opts.layers)
    if s.tensors is not None and full > opts.layers:
        keep = {n: t for n, t in s.tensors.items()
                if (names.any_layer_index(n) or 0) < opts.layers and names.mcore_part(n) != "mtp"}
        s.ignored, s.tensors = len(s.tensors) - len(keep), keep
    return s


def _load_mcore(p: Path, opts: Options, side: str, inspected: DcpCheckpoint | None) -> Side:
    ck = inspected if inspected is not None else inspect_torch_dist(p)
    config = load_config(_mcore_config_path(p, ck.iter_dir, opts))
    tensors = {n: (t.shape, t.dtype, ck.iter_dir.name) for n, t in ck.tensors.items()
               if not names.is_training_state(n)}
    s = Side(p, MCORE, config, tensors, objects=set(ck.objects))
    if ck.common_state is None:
        s.findings.append(Finding("missing", "common_state", ck.iter_dir.name,
                                  "common.pt or a common_state entry (args, checkpoint_version)", "absent", side))
    return s


def _mcore_config_path(p: Path, iter_dir: Path, opts: Options) -> Path:
    return Path(opts.config) if opts.config is not None else config_path(p, iter_dir, "--config")


def _cut(config: GlmConfig, opts: Options) -> GlmConfig:
    return config.cut(opts.layers) if opts.layers is not None else config


# ---- planning a side ---------------------------------------------------------------------------------

def plan_side(s: Side, opts: Options, side: str = "src") -> Plan:
    """The plan this side should match: explicit flags win, otherwise what the checkpoint holds."""
    tensors = s.tensors or {}
    layout = _layout(s, opts, side)
    present_parts = (names.mcore_parts_present(tensors) if s.kind == MCORE
                     else names.hf_parts_present(tensors, s.config.num_layers))
    fp8 = opts.fp8 if opts.fp8 is not None else s.kind == HF and _looks_fp8(s)
    mtp = opts.mtp if opts.mtp is not None else s.kind == CONFIG or "mtp" in present_parts
    vision = opts.vision if opts.vision is not None else s.kind == CONFIG or "vision" in present_parts
    prefix = s.text_prefix or names.HF_TEXT_PREFIX
    s.plan = s.plan_for(fp8=fp8 and s.kind != MCORE, mtp=mtp, vision=vision, text_prefix=prefix, layout=layout)
    return s.plan


def _layout(s: Side, opts: Options, side: str) -> str:
    """--layout, else (torch_dist) the one its names are spelled in, else the one glmconv.json records.

    A record the names contradict is a finding: the plan then follows the names, so the rest of the audit is
    about the tensors, not about the record.
    """
    if s.kind != MCORE:
        return opts.layout or DEFAULT_LAYOUT

    found = detect_layout(s.config, s.tensors or {})
    recorded = recorded_layout(s.path)
    if recorded is not None and found is not None and recorded != found:
        s.findings.append(Finding("layout", MANIFEST_NAME, MANIFEST_NAME, f"tensors named in the {recorded} layout",
                                  f"tensors named in the {found} layout", side))
    return opts.layout or found or recorded or DEFAULT_LAYOUT


def _looks_fp8(s: Side) -> bool:
    """The checkpoint's format, decided by a vote of its FP8-eligible weights (cached on the side).

    One stray F8_E4M3 tensor in a BF16 checkpoint (or one BF16 weight in the FP8 release) must not flip the
    plan: the plan follows the majority, so the findings, and the first error, name the minority tensors.
    """
    if s.fp8_vote is None:
        fp8, plain = fp8_votes(s)
        s.fp8_vote = len(fp8) > len(plain) or (len(fp8) == len(plain) > 0 and s.quantized)  # a tie: the config
    return s.fp8_vote


def fp8_votes(s: Side) -> tuple[list[str], list[str]]:
    """The weights the FP8 release stores as e4m3, split into those stored FP8 here (F8_E4M3 or with a
    `_scale_inv`) and those stored plainly; weights absent from the checkpoint do not vote."""
    tensors = s.tensors or {}
    if not any(names.scale_owner(n) is not None or t[1] == FP8 for n, t in tensors.items()):
        return [], []  # no FP8 evidence at all: BF16 without building the FP8 plan
    fp8: list[str] = []
    plain: list[str] = []
    for name in _fp8_eligible(s):
        if name in tensors:
            stored_fp8 = tensors[name][1] == FP8 or names.scale_name(name) in tensors
            (fp8 if stored_fp8 else plain).append(name)
    return fp8, plain


def _fp8_eligible(s: Side) -> set[str]:
    plan = s.plan_for(fp8=True, mtp=True, vision=True, text_prefix=s.text_prefix or names.HF_TEXT_PREFIX,
                      layout=DEFAULT_LAYOUT)
    return {n for n, spec in plan.hf_index.items() if spec.dtype == FP8}


# ---- comparing a side with its plan ------------------------------------------------------------------

def _fmt(spec: TensorSpec) -> str:
    return f"{spec.dtype}{list(spec.shape)}"


def compare_side(s: Side, opts: Options, side: str = "src") -> list[Finding]:
    """Every planned tensor present with its shape and dtype; nothing else present."""
    if s.tensors is None:
        return []
    expected, present = s.expected(), s.tensors
    findings: list[Finding] = []
    missing = set()
    for name, spec in expected.items():
        got = present.get(name)
        if got is None:
            missing.add(name)
        else:
            findings.extend(_check_one(name, spec, got, side))
    extra = [n for n in present if n not in expected]
    findings.extend(_classify_extra(s, extra, missing, side))
    findings.extend(_classify_missing(s, missing, side))
    if s.kind == HF:
        findings.extend(_prefix_finding(s, opts, side))
        findings.extend(_quantization_finding(s, side))
    if s.kind == MCORE and s.objects is not None:
        findings.extend(_missing_objects(s, side))
    return findings


def _missing_objects(s: Side, side: str) -> list[Finding]:
    """A Megatron trainer asks for every linear's `_extra_state`; without them a strict load fails."""
    assert s.plan is not None and s.objects is not None
    wanted = s.plan.mcore_objects()
    if s.ignored:  # --layers on a deeper checkpoint: only the audited layers' objects
        return []
    return [Finding("missing", key, s.path.name, "an _extra_state object (empty is fine)", "absent", side)
            for key in wanted if key not in s.objects]


def _check_one(name: str, spec: TensorSpec, got: Found, side: str) -> list[Finding]:
    shape, dtype, file = got
    if shape != spec.shape:
        kind = "scale-shape" if names.scale_owner(name) is not None else "shape"
        return [Finding(kind, name, file, str(list(spec.shape)), str(list(shape)), side)]
    if not spec.accepts(dtype):
        return [Finding("dtype", name, file, spec.expected_dtypes(), dtype, side)]
    return []


def _classify_extra(s: Side, extra: list[str], missing: set[str], side: str) -> list[Finding]:
    """Off-prefix tensors (matched to the planned name), orphan scales, and plain unexpected tensors."""
    assert s.plan is not None and s.tensors is not None
    out: list[Finding] = []
    for name in sorted(extra):
        shape, dtype, file = s.tensors[name]
        alt = names.swap_text_prefix(name, s.plan.text_prefix) if s.kind == HF else None
        if alt is not None and alt in missing:
            missing.discard(alt)
            out.append(Finding("prefix", name, file, alt, name, side))
            out.extend(_check_one(name, s.plan.hf_index[alt], s.tensors[name], side))
        elif names.scale_owner(name) is not None:
            out.append(Finding("orphan-scale", name, file, "no FP8 weight that pairs with it in the plan",
                               f"{dtype}{list(shape)}", side))
        else:
            out.append(Finding("unexpected", name, file, "not in the plan", f"{dtype}{list(shape)}", side))
    return out


def _classify_missing(s: Side, missing: set[str], side: str) -> list[Finding]:
    """A missing FP8 scale is `fp8-scale-missing` on its weight; with the weight gone too it folds into it."""
    assert s.tensors is not None
    out: list[Finding] = []
    expected = s.expected()
    for name in sorted(missing):
        owner = names.scale_owner(name)
        if owner is not None and owner in s.tensors:
            out.append(Finding("fp8-scale-missing", owner, s.tensors[owner][2], f"{name} {_fmt(expected[name])}",
                               "absent", side))
        elif owner is None or owner not in missing:
            scale = names.scale_name(name)
            also = f" + {names.SCALE_SUFFIX} {_fmt(expected[scale])}" if scale in missing else ""
            out.append(Finding("missing", name, "", _fmt(expected[name]) + also, "absent", side))
    return out


def _prefix_finding(s: Side, opts: Options, side: str) -> list[Finding]:
    """A checkpoint whose text tensors use the flat `model.` prefix (convert accepts it; the release does not)."""
    assert s.plan is not None
    if s.plan.text_prefix == names.HF_TEXT_PREFIX or opts.accept_flat_prefix:
        return []
    return [Finding("prefix", f"{names.HF_FLAT_PREFIX}*", "", f"text tensors under {names.HF_TEXT_PREFIX}",
                    f"text tensors under {names.HF_FLAT_PREFIX} (pass --accept-flat-prefix to accept)", side)]


def _quantization_finding(s: Side, side: str) -> list[Finding]:
    """config.json's quantization_config must agree with the tensors (the `_scale_inv` tensors are the truth)."""
    has_fp8 = _looks_fp8(s)
    if s.quantized == has_fp8:
        return []
    expected = "an fp8 quantization_config" if has_fp8 else "no fp8 quantization_config"
    found = ("none, but the checkpoint has FP8 tensors" if has_fp8
             else "quantization_config.quant_method fp8, but no tensor is FP8")
    return [Finding("config", "quantization_config", CONFIG_NAME, expected, found, side)]


# ---- comparing two sides through the mapping ---------------------------------------------------------

def _key(m: Mapping) -> tuple[str, ...]:
    """A mapping's identity on both sides: it depends on neither FP8, the HF prefix nor the Megatron layout."""
    return m.key


def _side_specs(s: Side, m: Mapping) -> list[TensorSpec]:
    if s.kind == MCORE:
        return list(m.mcore)
    return [*m.hf, *(x for x in m.scales if x is not None)]


def _present_keys(s: Side) -> set[tuple[str, ...]]:
    assert s.plan is not None
    if s.tensors is None:
        return {_key(m) for m in s.plan.mappings}
    return {_key(m) for m in s.plan.mappings if any(t.name in s.tensors for t in _side_specs(s, m))}


def cross_check(a: Side, b: Side, side_b: str, *, shapes: bool = True,
                left_out: frozenset[str] = frozenset()) -> list[Finding]:
    """Every mapping that `a` holds has its counterpart on `b` (and, with `shapes`, the shapes `a` implies).

    Mappings of the parts in `left_out` ("mtp", "vision") are not compared.
    """
    assert a.plan is not None and b.plan is not None
    b_maps = {_key(m): m for m in b.plan.mappings}
    b_full: dict[tuple[str, ...], Mapping] | None = None  # only where a counterpart is absent
    out: list[Finding] = []
    for key in sorted(_present_keys(a)):
        m_a = a.plan.mapping_of_key[key]
        if m_a.optional_part(a.config.num_layers) in left_out:
            continue
        m_b = b_maps.get(key)
        if m_b is None:
            b_full = b_full if b_full is not None else _full_plan(b)
            out.extend(_absent_counterpart(a, b, m_a, b_full.get(key), side_b))
        elif shapes and [t.shape for t in m_a.mcore] != [t.shape for t in m_b.mcore]:
            out.extend(_shape_mismatch(a, b, m_a, m_b, side_b))
    return out


def _full_plan(s: Side) -> dict[tuple[str, ...], Mapping]:
    """`s`'s plan with every part (MTP, vision), by mapping key: what a counterpart it lacks would have been."""
    assert s.plan is not None
    full = s.plan_for(fp8=s.plan.fp8, mtp=True, vision=True, text_prefix=s.plan.text_prefix, layout=s.plan.layout)
    return {_key(m): m for m in full.mappings}


def _counterparts(a: Side, b: Side, m_a: Mapping) -> list[TensorSpec]:
    """`m_a`'s tensors spelled for side `b` (its kind, text prefix and layout): weights only, no FP8 scales."""
    assert b.plan is not None
    if b.kind == MCORE:  # b's layout names them; the shapes follow from a's HF shapes through b's transform
        m_b = b.plan.mapping_of_key.get(m_a.key)
        if m_b is None:
            return list(m_a.mcore)
        shapes = m_b.rule.transform.mcore_shapes([t.shape for t in m_a.hf], len(m_b.mcore))
        return [TensorSpec(t.name, shape, t.dtype) for t, shape in zip(m_b.mcore, shapes)]
    return [TensorSpec(names.swap_text_prefix(t.name, b.plan.text_prefix) or t.name, t.shape, t.dtype)
            for t in m_a.hf]


def _absent_counterpart(a: Side, b: Side, m_a: Mapping, m_b: Mapping | None, side_b: str) -> list[Finding]:
    src = _side_specs(a, m_a)[0].name
    specs = _side_specs(b, m_b) if m_b is not None else _counterparts(a, b, m_a)
    tensors = b.tensors or {}
    return [Finding("missing", t.name, "", f"{_fmt(t)} (maps from {src})",
                    "absent" if t.name not in tensors else "present, but outside this side's plan", side_b)
            for t in specs]


def _shape_mismatch(a: Side, b: Side, m_a: Mapping, m_b: Mapping, side_b: str) -> list[Finding]:
    """`b`'s planned shapes against the ones `a`'s plan implies for the same mapping, named for side `b`."""
    src = _side_specs(a, m_a)[0].name
    want, have = _counterparts(a, b, m_a), _counterparts(b, b, m_b)
    return [Finding("shape", h.name, "", f"{list(w.shape)} (implied by {src})", str(list(h.shape)), side_b)
            for w, h in zip(want, have) if w.shape != h.shape]


def config_findings(a: Side, b: Side, side_b: str) -> list[Finding]:
    """Configs that disagree on any dimension or on the layer schedule."""

    da, db = dims(a.config), dims(b.config)
    out = [Finding("config", k, CONFIG_NAME, str(da.get(k)), str(db.get(k)), side_b)
           for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]
    for what, x, y in (("attention schedule", a.config.attn_types, b.config.attn_types),
                       ("mlp schedule", a.config.mlp_types, b.config.mlp_types),
                       ("indexer schedule", a.config.indexer_full, b.config.indexer_full),
                       ("mtp layers", a.config.num_mtp_layers, b.config.num_mtp_layers)):
        if x != y:
            out.append(Finding("config", what, CONFIG_NAME, str(x), str(y), side_b))
    return out


# ---- entry points ------------------------------------------------------------------------------------

def audit(src: str | Path, against: str | Path | None = None, *, fp8: bool | None = None, mtp: bool | None = None,
          vision: bool | None = None, layers: int | None = None, accept_flat_prefix: bool = False,
          config: str | Path | None = None, layout: str | None = None,
          against_inspected: DcpCheckpoint | None = None) -> AuditReport:
    """Audit SRC against the plan its config implies; with `against`, also both sides through the mapping
    (`against_inspected`: a torch_dist `against` already inspected, as `load_side` takes it)."""
    opts = Options(fp8=fp8, mtp=mtp, vision=vision, layers=layers, accept_flat_prefix=accept_flat_prefix,
                   config=config, layout=layout)
    # with --against, --no-mtp / --no-vision describe the output: SRC is audited as it is, and the parts
    # left out are not compared (what `convert --no-mtp` does to a checkpoint that has the MTP layer)
    src_opts = opts if against is None else dataclasses.replace(opts, mtp=None, vision=None)
    a = load_side(src, src_opts, "src")
    plan_side(a, src_opts)
    findings = [*a.findings, *compare_side(a, src_opts, "src")]
    plans = {"src": a.plan_options()}
    b = None
    if against is not None:
        left_out = frozenset(part for part, keep in (("mtp", mtp), ("vision", vision)) if keep is False)
        b = load_side(against, opts, "against", against_inspected)
        plan_side(b, opts, "against")
        plans["against"] = b.plan_options()
        findings += [*b.findings, *compare_side(b, opts, "against"), *config_findings(a, b, "against")]
        findings += [*cross_check(a, b, "against", left_out=left_out),
                     *cross_check(b, a, "src", shapes=False, left_out=left_out)]
    return AuditReport(src=str(src), against=None if against is None else str(against),
                       tensors=len(a.expected()), against_tensors=None if b is None else len(b.expected()),
                       findings=_dedupe(findings), plans=plans)


def output_findings(src: Path, out: Path, src_opts: Options, out_opts: Options) -> list[Finding]:
    """What a freshly written output gets wrong: against its own plan, and through the mapping against its source
    (both ways); `out` is the "against" side. The source itself is not audited again."""
    a, b = load_side(src, src_opts), load_side(out, out_opts, "against")
    plan_side(a, src_opts)
    plan_side(b, out_opts, "against")
    return [*b.findings, *compare_side(b, out_opts, "against"), *config_findings(a, b, "against"),
            *cross_check(a, b, "against"), *cross_check(b, a, "src", shapes=False)]


def refuse(stage: Path, findings: list[Finding]) -> None:
    """One line naming the first finding of a staged output's verification, if any: nothing is then published."""
    if findings:
        f = findings[0]
        raise CheckpointError(f"verification of {stage} failed: {f.tensor}: {f.kind}: expected {f.expected}, "
                              f"found {f.found}")


def _dedupe(findings: Iterable[Finding]) -> list[Finding]:
    """Keep the first finding per (side, tensor); the per-side audit comes before the cross-check."""
    seen: set[tuple[str, str, str]] = set()
    out: list[Finding] = []
    for f in findings:
        key = (f.side, f.tensor, f.kind if f.kind in ("config", "prefix", "index", "duplicate") else "")
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def expected_tensors(src: str | Path, side: str = HF, *, fp8: bool = False, mtp: bool = True, vision: bool = True,
                     layers: int | None = None, config: str | Path | None = None,
                     layout: str | None = None) -> list[TensorSpec]:
    """The full list of tensors the plan expects on one side, for `--emit`."""
    cfg = _cut(_config_of(Path(src), config), Options(layers=layers))
    plan = build_plan(cfg, fp8=fp8, mtp=mtp, vision=vision, layout=layout or DEFAULT_LAYOUT)
    return list(plan.hf_tensors() if side == HF else plan.mcore_tensors())


def _config_of(p: Path, override: str | Path | None) -> GlmConfig:
    """The config of SRC without reading any tensor metadata."""
    if override is not None:
        return load_config(override)
    kind = detect_kind(p)
    if kind in (CONFIG, HF):
        return load_config(p)

    return load_config(_mcore_config_path(p, resolve_iter_dir(p)[0], Options()))
