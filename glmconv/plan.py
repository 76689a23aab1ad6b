"""Rules x config -> the full plan: every HF tensor, every Megatron tensor, shapes, dtypes, bytes."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from glmconv import arguments as A
from glmconv.config import DSA, MOE, GlmConfig
from glmconv.defaults import DEFAULT_LAYOUT, DTYPE_CHOICES, KEEP, LAYOUT_CHOICES
from glmconv.io.dtypes import DTYPE_SIZES
from glmconv.numerics.fp8 import scale_shape
from glmconv.rules import layouts, names
from glmconv.rules.ops import Layout
from glmconv.rules.table import BF16, F32, FP8, GLOBAL, LAYER, MTP, VISION, Rule, rules_in

__all__ = ["BF16", "F32", "FP8", "Mapping", "Plan", "TensorSpec", "build_plan", "detect_layout", "dims", "retyped"]


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor with its global shape and safetensors dtype code."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the plan's own: what is written when nothing else says
    accepted: tuple[str, ...] = ()  # also accepted on disk (the rule's dtype policy)

    def accepts(self, dtype: str) -> bool:
        return dtype == self.dtype or dtype in self.accepted

    def expected_dtypes(self) -> str:
        """What `accepts` takes, for a message: `BF16 or F32`."""
        return " or ".join(dict.fromkeys((self.dtype, *self.accepted)))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def as_json(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Mapping:
    """One expanded rule: these HF tensors become these Megatron tensors through `rule.transform`."""

    rule: Rule
    hf: tuple[TensorSpec, ...]
    mcore: tuple[TensorSpec, ...]
    scales: tuple[TensorSpec | None, ...]  # FP8 `_scale_inv` per HF tensor, when the plan is FP8
    layer: int | None  # HF layer index (MTP layers count after the decoder), None for global/vision
    part: str  # "global", "layer", "mtp" or "vision"
    stored: tuple[str | None, ...] = ()  # per HF tensor, the dtype the source stores (None: unknown)
    key: tuple[str, ...] = ()  # the miles layout's Megatron names: the mapping's identity in every layout
    homeless: bool = False  # the layout's trainer has no parameter for it: kept under names.KEPT_PREFIX

    def optional_part(self, num_layers: int) -> str:
        """The part a mapping can be left out with: the MTP layer's decoder-layer rules have scope "layer"."""
        return "mtp" if self.layer is not None and self.layer >= num_layers else self.part

    def byte_layout(self, hf_dtypes: Sequence[str | None], *, backward: bool = False) -> Layout | None:
        """The transform's byte layout when this mapping only moves bytes, else None.

        `hf_dtypes`: the HF side's dtypes as stored (convert) or as written (export), None where unknown.
        Bytes only move when both sides have one dtype and there is no FP8 scale.
        """
        dtype = self.mcore[0].dtype
        if (any(s for s in self.scales) or dtype not in DTYPE_SIZES or any(t.dtype != dtype for t in self.mcore)
                or any(d != dtype for d in hf_dtypes)):
            return None
        layout = self.rule.transform.backward_layout if backward else self.rule.transform.forward_layout
        return layout([t.shape for t in self.hf], DTYPE_SIZES[dtype], len(self.mcore))

    @property
    def by_rows(self) -> bool:
        """The one Megatron tensor splits by rows into whole HF tensors (stacked experts)."""
        return len(self.mcore) == 1 and self.rule.transform.hf_for_rows(range(0), len(self.hf)) is not None

    def row_steps(self, step_bytes: int) -> list[tuple[range, list[int]]] | None:
        """A stacked Megatron tensor a few rows (experts) at a time, at most `step_bytes` a step (one row at
        least): each step's rows and the HF tensors behind them; None when the mapping moves whole tensors."""
        if not self.by_rows:
            return None
        spec = self.mcore[0]
        n = spec.shape[0]
        per = max(1, min(n, step_bytes // max(1, spec.nbytes // n)))
        steps = [range(start, min(n, start + per)) for start in range(0, n, per)]
        return [(rows, self.rule.transform.hf_for_rows(rows, len(self.hf)) or []) for rows in steps]

    @property
    def hf_bytes(self) -> int:
        """Bytes of the HF tensors as the source stores them (an F32 save is twice its BF16 plan), scales included."""
        stored = self.stored or (None,) * len(self.hf)
        sizes = [DTYPE_SIZES.get(d or t.dtype, DTYPE_SIZES[t.dtype]) for t, d in zip(self.hf, stored)]
        return sum(math.prod(t.shape) * n for t, n in zip(self.hf, sizes)) + sum(s.nbytes for s in self.scales if s)

    @property
    def mcore_bytes(self) -> int:
        return sum(t.nbytes for t in self.mcore)


@dataclass
class Plan:
    """The complete, bijective tensor plan for one config and one set of options."""

    config: GlmConfig
    fp8: bool
    mtp: bool
    vision: bool
    text_prefix: str
    mappings: list[Mapping] = field(default_factory=list)
    dtype: str = KEEP  # convert --dtype: what the Megatron tensors become (the rules' dtype policies)
    layout: str = DEFAULT_LAYOUT  # the Megatron layout (glmconv.rules.layouts): whose names the Megatron side has

    @property
    def hf_bytes(self) -> int:
        """The HF side's bytes as the source stores them, scales included."""
        return sum(m.hf_bytes for m in self.mappings)

    @property
    def mcore_bytes(self) -> int:
        return sum(m.mcore_bytes for m in self.mappings)

    def hf_tensors(self) -> Iterator[TensorSpec]:
        for m in self.mappings:
            for t, s in zip(m.hf, m.scales):
                yield t
                if s is not None:
                    yield s

    def mcore_tensors(self) -> Iterator[TensorSpec]:
        for m in self.mappings:
            yield from m.mcore

    def mcore_objects(self) -> list[str]:
        """`_extra_state` ShardedObject keys a Megatron model of this plan asks for at load."""
        keys: list[str] = []
        for m in self.mappings:
            if m.rule.extra_state and not m.homeless:
                experts = m.mcore[0].shape[0] if m.rule.per_expert else None
                keys.extend(names.extra_state_keys(m.mcore[0].name, experts))
        return keys

    @cached_property
    def hf_index(self) -> dict[str, TensorSpec]:
        return _unique_index(self.hf_tensors(), "HF")

    @cached_property
    def mcore_index(self) -> dict[str, TensorSpec]:
        return _unique_index(self.mcore_tensors(), "Megatron")

    @cached_property
    def mapping_of_hf(self) -> dict[str, Mapping]:
        return {t.name: m for m in self.mappings for t in (*m.hf, *(s for s in m.scales if s))}

    @cached_property
    def mapping_of_mcore(self) -> dict[str, Mapping]:
        return {t.name: m for m in self.mappings for t in m.mcore}

    @cached_property
    def mapping_of_key(self) -> dict[tuple[str, ...], Mapping]:
        """Mappings by their layout-independent identity (`Mapping.key`)."""
        return {m.key: m for m in self.mappings}

    def homeless(self) -> list[Mapping]:
        """The mappings this layout's trainer has no parameter for (kept under names.KEPT_PREFIX)."""
        return [m for m in self.mappings if m.homeless]


def _unique_index(specs: Iterator[TensorSpec], side: str) -> dict[str, TensorSpec]:
    index: dict[str, TensorSpec] = {}
    for s in specs:
        if s.name in index:
            raise AssertionError(f"mapping rules produce the {side} tensor {s.name} twice")
        index[s.name] = s
    return index


def dims(config: GlmConfig) -> dict[str, int]:
    """Named dimensions the rule shapes refer to."""
    t = config.text
    heads = t["num_attention_heads"]
    hc = t["hc_mult"]
    d = {
        "hidden": t["hidden_size"], "vocab": t["vocab_size"], "inter": t["intermediate_size"],
        "moe_inter": t["moe_intermediate_size"], "shared_inter": t["moe_intermediate_size"] * t["n_shared_experts"],
        "experts": t["n_routed_experts"], "kda_heads": t["linear_num_heads"], "kda_head": t["linear_head_dim"],
        "kda_dim": t["linear_num_heads"] * t["linear_head_dim"], "conv_k": t["linear_conv_kernel_dim"],
        "q_lora": t["q_lora_rank"], "kv_lora": t["kv_lora_rank"],
        "mla_q": heads * (t["qk_nope_head_dim"] + t["qk_rope_head_dim"]),
        "mla_kv_a": t["kv_lora_rank"] + t["qk_rope_head_dim"],
        "mla_kv_b": heads * (t["qk_nope_head_dim"] + t["v_head_dim"]), "mla_o": heads * t["v_head_dim"],
        "idx_q": t["index_n_heads"] * t["index_head_dim"], "idx_dim": t["index_head_dim"],
        "idx_heads": t["index_n_heads"], "kpool": t["index_kpool"], "hc_mix": (2 + hc) * hc,
        "hc_in": hc * t["hidden_size"], "eh_in": 2 * t["hidden_size"],
    }
    v = config.vision
    if v is not None:
        d.update(v_hidden=v.hidden, v_inter=v.intermediate, v_qkv=3 * v.hidden, v_head=v.hidden // v.heads,
                 v_in=v.in_channels, v_tpatch=v.temporal_patch, v_patch=v.patch, v_out=v.out_hidden,
                 v_merge=v.merge, v_proj_inter=v.proj_intermediate)
    return d


@A.keywords_checked
def build_plan(config: GlmConfig, *, fp8: bool = False, mtp: bool = True, vision: bool = True,
               text_prefix: str = names.HF_TEXT_PREFIX, dtype: str = KEEP,
               stored: dict[str, str] | None = None, layout: str = DEFAULT_LAYOUT) -> Plan:
    """Expand every rule against `config`; MTP and vision are included when the config has them.

    `config`: a GlmConfig (`glmconv.load_config` reads one). `dtype` (convert --dtype) and `stored` (HF tensor ->
    the dtype the source stores) fix each Megatron dtype; `layout` names the Megatron side (glmconv.rules.layouts).
    """
    if not isinstance(config, GlmConfig):
        raise A.ArgumentError("config", config, "expected a GlmConfig; glmconv.load_config(path) reads one from a "
                              "config.json or a checkpoint directory")
    for flag, value in (("fp8", fp8), ("mtp", mtp), ("vision", vision)):
        A.flag(flag, value)
    if not isinstance(text_prefix, str):
        raise A.ArgumentError("text_prefix", text_prefix, "expected a str such as 'model.language_model.'")
    A.choice("dtype", dtype, DTYPE_CHOICES)
    A.optional(A.names_to, "stored", stored, "safetensors dtypes such as 'BF16'")
    A.choice("layout", layout, LAYOUT_CHOICES)
    options = (fp8, mtp, vision, text_prefix, dtype, tuple(sorted((stored or {}).items())), layout)
    return _BUILT.copy_of(config, options, lambda: _expanded(config, fp8, mtp, vision, text_prefix, dtype, stored,
                                                              layout))


def _expanded(config: GlmConfig, fp8: bool, mtp: bool, vision: bool, text_prefix: str, dtype: str,
              stored: dict[str, str] | None, layout: str) -> Plan:
    """Every rule expanded against `config`, the bijection checked: what `build_plan` keeps."""
    plan = Plan(config=config, fp8=fp8, mtp=mtp and config.num_mtp_layers > 0,
                vision=vision and config.vision is not None, text_prefix=text_prefix, dtype=dtype,
                layout=layout)
    d = dims(config)
    homeless_parts = layouts.layout(plan.layout).homeless_parts
    for scope, ctx in _scopes(plan):
        for rule in rules_in(plan.layout):
            if _applies(rule, scope, ctx, config):
                m = _expand(rule, ctx, d, plan, stored or {})
                plan.mappings.append(_placed(m, ctx, homeless_parts, config.num_layers))
    plan.hf_index, plan.mcore_index  # noqa: B018 - validates the bijection now, not at first use
    return plan


class _BuiltPlans:
    """The last few plans built, by their config's content and options: one run builds the same plan several times
    (the layout's detection, the job's, the audit's own: 7 plans of 5,448 HF tensors on a 3 GB bench export). Each
    caller gets its own Plan (mappings list and indexes copied); the mappings and specs are frozen, shared."""

    KEEP = 4

    def __init__(self) -> None:
        self._plans: dict[tuple[object, ...], Plan] = {}
        self._lock = threading.Lock()

    def copy_of(self, config: GlmConfig, options: tuple[object, ...], build: Callable[[], Plan]) -> Plan:
        key: tuple[object, ...] = (_content(config), *options)
        with self._lock:
            plan = self._plans.pop(key, None)
        if plan is None:
            plan = build()
        with self._lock:
            self._plans[key] = plan  # the newest last
            while len(self._plans) > self.KEEP:
                del self._plans[next(iter(self._plans))]
        return _copied(plan, config)


def _content(config: GlmConfig) -> str:
    """What a plan depends on in `config`: the fields its equality compares (`raw` is not one)."""
    return repr(tuple(getattr(config, f.name) for f in dataclasses.fields(config) if f.compare))


def _copied(plan: Plan, config: GlmConfig) -> Plan:
    """`plan` as a new Plan of `config` (the caller's, `raw` and all): its own mappings list and its own copies of
    the indexes it has computed."""
    copy = dataclasses.replace(plan, config=config, mappings=list(plan.mappings))
    fields = {f.name for f in dataclasses.fields(Plan)}
    for name, value in vars(plan).items():
        if isinstance(value, dict) and name not in fields:
            vars(copy)[name] = dict(value)  # a cached_property's index
    return copy


_BUILT = _BuiltPlans()


def _placed(m: Mapping, ctx: _Ctx, homeless_parts: frozenset[str], num_layers: int) -> Mapping:
    """`m` with its layout-independent key, and kept under names.KEPT_PREFIX where the layout has no home for it."""
    key = tuple(names.expand(t, **_side(ctx, 1)) for t in m.rule.miles or m.rule.mcore)
    homeless = m.rule.homeless or m.optional_part(num_layers) in homeless_parts
    if not homeless:
        return dataclasses.replace(m, key=key)
    mcore = tuple(dataclasses.replace(t, name=names.kept(t.name)) for t in m.mcore)
    return dataclasses.replace(m, key=key, mcore=mcore, homeless=True)


def detect_layout(config: GlmConfig, keys: Iterable[str]) -> str | None:
    """The Megatron layout whose names a checkpoint's keys are spelled in; None when no key says.

    Decided by the names only one layout has: the plans of both, with every part, are compared to the keys.
    """
    hits = {name: set(build_plan(config, layout=name).mcore_index) for name in LAYOUT_CHOICES}
    shared = set.intersection(*hits.values())
    score = {name: len((own - shared) & set(keys)) for name, own in hits.items()}
    best = max(score, key=lambda n: score[n])
    return best if score[best] else None


def retyped(plan: Plan, mcore_dtypes: dict[str, str]) -> Plan:
    """`plan` with the Megatron dtypes a torch_dist checkpoint holds (each one its spec accepts)."""
    def spec(t: TensorSpec) -> TensorSpec:
        return dataclasses.replace(t, dtype=mcore_dtypes.get(t.name, t.dtype))

    maps = [dataclasses.replace(m, mcore=tuple(spec(t) for t in m.mcore)) for m in plan.mappings]
    return dataclasses.replace(plan, mappings=maps)


@dataclass(frozen=True)
class _Ctx:
    values: dict[str, object]
    layer: int | None = None
    attn: str | None = None
    mlp: str | None = None
    hc: bool = False
    block: int | None = None
    indexer: bool = True


def _scopes(plan: Plan) -> Iterator[tuple[str, _Ctx]]:
    cfg, tp = plan.config, plan.text_prefix
    yield GLOBAL, _Ctx({"text": tp})
    has_hc = bool(cfg.text.get("mhc", True))
    for i in range(cfg.num_layers):
        yield LAYER, _Ctx({"layer": (names.hf_layer(tp, i), names.mcore_layer(i))}, i, cfg.attn_types[i],
                          cfg.mlp_types[i], has_hc, indexer=cfg.indexer_full[i])
    if plan.mtp:
        for k in range(cfg.num_mtp_layers):
            hf_l = cfg.mtp_layer_index + k
            yield LAYER, _Ctx({"layer": (names.hf_layer(tp, hf_l), names.mcore_mtp_layer(k))}, hf_l, DSA, MOE)
            yield MTP, _Ctx({"layer": (names.hf_layer(tp, hf_l), None), "mtp": names.mcore_mtp(k)}, hf_l)
    if plan.vision:
        yield VISION, _Ctx({"visual": names.HF_VISUAL_PREFIX})
        for b in range(cfg.vision.depth):  # type: ignore[union-attr]  # plan.vision: the config has one
            yield VISION, _Ctx({"visual": names.HF_VISUAL_PREFIX, "b": b}, block=b)


def _applies(rule: Rule, scope: str, ctx: _Ctx, config: GlmConfig) -> bool:
    if rule.scope != scope:
        return False
    if rule.attn and rule.attn != ctx.attn or rule.mlp and rule.mlp != ctx.mlp:
        return False
    if rule.hc and not ctx.hc or rule.indexer and not ctx.indexer or rule.per_block != (ctx.block is not None):
        return False
    return not (rule.needs_shared_experts and config.text["n_shared_experts"] == 0)


def _side(ctx: _Ctx, side: int) -> dict[str, object]:
    return {k: (v[side] if isinstance(v, tuple) else v) for k, v in ctx.values.items()}


def _expand(rule: Rule, ctx: _Ctx, d: dict[str, int], plan: Plan, stored: dict[str, str]) -> Mapping:
    hf_ctx, mc_ctx = _side(ctx, 0), _side(ctx, 1)
    shapes = [tuple(x if isinstance(x, int) else d[x] for x in s) for s in rule.shapes]
    reps = _repeats(rule, plan.config)
    hf_names = [names.expand(t, **hf_ctx, **{rule_key: i}) if rule_key else names.expand(t, **hf_ctx)
                for t in rule.hf for rule_key, i in reps]
    hf_shapes = [s for s in shapes for _ in reps]
    mc_names = [names.expand(t, **mc_ctx) for t in rule.mcore]
    return _mapping(rule, ctx, hf_names, hf_shapes, mc_names, plan, tuple(stored.get(n) for n in hf_names))


def _repeats(rule: Rule, config: GlmConfig) -> list[tuple[str | None, int]]:
    if rule.per_expert:
        return [("e", e) for e in range(config.text["n_routed_experts"])]
    return [(None, 0)]


def _mapping(rule: Rule, ctx: _Ctx, hf_names: list[str], hf_shapes: list[tuple[int, ...]],
             mc_names: list[str], plan: Plan, stored: tuple[str | None, ...]) -> Mapping:
    """HF specs by the rule's dtype policy (FP8 alone where the plan is FP8); Megatron's by --dtype and `stored`."""
    policy = rule.dtypes
    fp8 = plan.fp8 and rule.fp8
    hf_dtype, accepted = (FP8, ()) if fp8 else (policy.export_default, policy.accepted)
    hf = tuple(TensorSpec(n, s, hf_dtype, accepted) for n, s in zip(hf_names, hf_shapes))
    scales = tuple(TensorSpec(names.scale_name(n), scale_shape(s), F32) if fp8 else None
                   for n, s in zip(hf_names, hf_shapes))
    mc_shapes = rule.transform.mcore_shapes(hf_shapes, len(mc_names))
    mc_dtype = policy.megatron_dtype(plan.dtype, stored)
    mc = tuple(TensorSpec(n, s, mc_dtype, policy.megatron_dtypes()) for n, s in zip(mc_names, mc_shapes))
    return Mapping(rule=rule, hf=hf, mcore=mc, scales=scales, layer=ctx.layer, part=rule.scope, stored=stored)
