"""The mapping table: every GLM-5.3-Flash tensor, its Megatron name, transform, shape and dtype policy.

This module and `glmconv.rules.names` are the only places tensor names are spelled. Templates use
`{text}` (HF text prefix), `{layer}` (a layer's prefix on either side), `{mtp}` (a Megatron MTP layer),
`{visual}` (HF vision prefix), `{e}` (expert) and `{b}` (vision block). Shapes are tuples of dimension
names resolved by `glmconv.plan` from the config (see `dims()` there).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from glmconv.config import DENSE, DSA, KDA, MOE
from glmconv.defaults import DEFAULT_LAYOUT, KEEP, MCORE, TO_BF16, TO_FP32
from glmconv.rules import names
from glmconv.rules import roles as R
from glmconv.rules.layouts import layout
from glmconv.rules.ops import Concat, Rename, SplitVector, StackExperts, Transform

GLOBAL, LAYER, MTP, VISION = "global", "layer", "mtp", "vision"
F32, BF16, FP8 = "F32", "BF16", "F8_E4M3"

AS_STORED = "as stored"


@dataclass(frozen=True)
class DtypePolicy:
    """One rule's dtypes: what the release stores, what a checkpoint may store (transformers' own save_pretrained
    keeps conv1d modules F32 and a full-F32 save is common), what Megatron gets under each `--dtype` choice, and
    what export writes when nothing records the source's dtype (a checkpoint converted by an older glmconv)."""

    name: str
    release: str
    accepted: tuple[str, ...]
    megatron: tuple[tuple[str, str], ...]  # (--dtype choice, Megatron dtype or AS_STORED)
    export_default: str

    def megatron_dtype(self, choice: str, stored: Sequence[str | None] = ()) -> str:
        """The Megatron dtype under `choice` for HF tensors stored as `stored` (None: unknown, the release's).

        As stored: FP8 is dequantised to BF16; HF tensors of one mapping stored in different dtypes meet in F32,
        the wider, so that none is rounded.
        """
        want = dict(self.megatron)[choice]
        if want != AS_STORED:
            return want
        found = {BF16 if d == FP8 else d or self.release for d in stored} or {self.release}
        return found.pop() if len(found) == 1 else F32

    def megatron_dtypes(self) -> tuple[str, ...]:
        """Every dtype a Megatron tensor of this rule may hold (whatever --dtype made it)."""
        out = [d for _, want in self.megatron for d in ((BF16, F32) if want == AS_STORED else (want,))]
        return tuple(dict.fromkeys(out))


WEIGHT = DtypePolicy("weight", release=BF16, accepted=(BF16, F32),
                     megatron=((KEEP, AS_STORED), (TO_BF16, BF16), (TO_FP32, F32)), export_default=BF16)
# Computed in F32 by the model (A_log, dt_bias, hyper-connections, the router bias): F32 in Megatron whatever
# --dtype says; a BF16 copy on disk is widened exactly.
F32_STATE = DtypePolicy("f32", release=F32, accepted=(F32, BF16),
                        megatron=((KEEP, F32), (TO_BF16, F32), (TO_FP32, F32)), export_default=F32)
# The same, but the release stores them BF16: its total_size (328,326,771,576 bytes) is only reached with the
# hc_*_fn and the kpool ape in BF16 (the design notes say F32).
F32_STATE_BF16_RELEASE = DtypePolicy("f32-bf16-release", release=BF16, accepted=(F32, BF16),
                                     megatron=F32_STATE.megatron, export_default=F32)
POLICIES = (WEIGHT, F32_STATE, F32_STATE_BF16_RELEASE)


@dataclass(frozen=True)
class Home:
    """Where a layout other than miles keeps a rule's Megatron tensors: its names and transform, or none at all
    (`homeless`: its trainer has no parameter for them; they are kept under `names.KEPT_PREFIX`)."""

    mcore: tuple[str, ...]
    transform: Transform = Rename()
    homeless: bool = False
    extra_state: bool | None = None  # whether its module saves `_extra_state` there (None: as in miles)


@dataclass(frozen=True)
class Rule:
    """One declarative mapping between HF tensor(s) and Megatron tensor(s) (`mcore`: the miles layout's)."""

    hf: tuple[str, ...]
    mcore: tuple[str, ...]
    shapes: tuple[tuple[str | int, ...], ...]
    transform: Transform = Rename()
    scope: str = LAYER
    attn: str | None = None  # only layers of this attention type
    mlp: str | None = None  # only layers of this MLP type
    indexer: bool = False  # only DSA layers that run their own indexer (indexer_types "full")
    hc: bool = False  # only decoder layers with hyper-connections (not the MTP layer)
    dtypes: DtypePolicy = WEIGHT  # release, accepted and Megatron dtypes
    fp8: bool = False  # in the release's FP8 set (e4m3 + `_scale_inv`)
    per_expert: bool = False  # HF templates expand over `{e}` in 0..n_routed_experts-1
    needs_shared_experts: bool = False
    per_block: bool = False  # vision templates expand over `{b}` in 0..depth-1
    extra_state: bool = False  # the Megatron module is a Transformer Engine one (linear or norm): it saves an
    # `_extra_state` object, which a trainer requests at load (a norm fused into a TE linear is the linear's)
    role: str = ""  # what the tensor is to a model (`glmconv.rules.roles`): models and fixtures look it up
    homes: tuple[tuple[str, Home], ...] = ()  # layout -> Home, where it differs from miles
    homeless: bool = False  # set by `in_layout`: no parameter of this layout's trainer holds the tensors
    miles: tuple[str, ...] = ()  # set by `in_layout`: the miles templates, the rule's identity in every layout

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.hf):
            raise ValueError(f"rule {self.hf}: one shape per HF template")

    def in_layout(self, name: str) -> Rule:
        """This rule as `name` lays it out: the same HF side, that layout's Megatron names and transform."""
        home = dict(self.homes).get(layout(name).name)
        if home is None:
            return self
        extra_state = self.extra_state if home.extra_state is None else home.extra_state
        return dataclasses.replace(self, mcore=home.mcore, transform=home.transform, homeless=home.homeless,
                                   extra_state=extra_state and not home.homeless, miles=self.mcore, homes=())

    @property
    def key(self) -> str:
        """The rule's name in every layout: its first miles Megatron template (unique in the table)."""
        return (self.miles or self.mcore)[0]

    @property
    def keep_f32(self) -> bool:
        """F32 in Megatron whatever --dtype says."""
        return self.dtypes.megatron_dtypes() == (F32,)


def _r(hf: str | tuple[str, ...], mcore: str | tuple[str, ...], *shapes: tuple[str | int, ...],
       native: str | tuple[str, ...] | Home | None = None, **kw: object) -> Rule:
    """A rule; `native`: its Megatron name(s) in the mcore layout (a `Home` where the transform differs too)."""
    hf_t = (hf,) if isinstance(hf, str) else hf
    mc_t = (mcore,) if isinstance(mcore, str) else mcore
    if isinstance(native, str | tuple):
        kw["homes"] = ((MCORE, Home((native,) if isinstance(native, str) else native)),)
    elif isinstance(native, Home):
        kw["homes"] = ((MCORE, native),)
    return Rule(hf=hf_t, mcore=mc_t, shapes=shapes, **kw)  # type: ignore[arg-type]  # kw: optional Rule fields


def _hc(site_hf: str, site_mc: str) -> list[Rule]:
    """The three hyper-connection tensors of one site (attn or ffn)."""
    return [
        _r(f"{{layer}}hc_{site_hf}_fn", f"{{layer}}{site_mc}_hyper_connection.mapping_proj.weight",
           ("hc_mix", "hc_in"), hc=True, dtypes=F32_STATE_BF16_RELEASE, role=R.HC[site_hf][0]),
        _r(f"{{layer}}hc_{site_hf}_base", f"{{layer}}{site_mc}_hyper_connection.bias", ("hc_mix",),
           hc=True, dtypes=F32_STATE, role=R.HC[site_hf][1]),
        _r(f"{{layer}}hc_{site_hf}_scale",
           tuple(f"{{layer}}{site_mc}_hyper_connection.alpha_{a}" for a in ("pre", "post", "res")),
           (3,), transform=SplitVector(), hc=True, dtypes=F32_STATE, role=R.HC[site_hf][2]),
    ]


def _kda() -> list[Rule]:
    rules = [_r(f"{{layer}}self_attn.{p}_proj.weight", f"{{layer}}self_attention.kda.{p}_proj.weight", shape,
                native=f"{{layer}}self_attention.{p}_proj.weight", attn=KDA, extra_state=True, role=R.KDA_PROJ[p])
             for p, shape in (("q", ("kda_dim", "hidden")), ("k", ("kda_dim", "hidden")),
                              ("v", ("kda_dim", "hidden")), ("b", ("kda_heads", "hidden")),
                              ("f_a", ("kda_head", "hidden")), ("f_b", ("kda_dim", "kda_head")),
                              ("g_a", ("kda_head", "hidden")), ("g_b", ("kda_dim", "kda_head")),
                              ("o", ("hidden", "kda_dim")))]
    rules += [
        # miles packs the three short convs into one; megatron-core's KDA keeps one per projection
        _r(tuple(f"{{layer}}self_attn.{p}_conv1d.weight" for p in "qkv"), "{layer}self_attention.kda.conv1d.weight",
           *[("kda_dim", 1, "conv_k")] * 3, transform=Concat(0), attn=KDA, role=R.KDA_CONV,
           native=tuple(f"{{layer}}self_attention.{p}_conv1d.weight" for p in "qkv")),
        _r("{layer}self_attn.A_log", "{layer}self_attention.kda.A_log", ("kda_heads",), attn=KDA, dtypes=F32_STATE,
           native="{layer}self_attention.A_log", role=R.KDA_A_LOG),
        _r("{layer}self_attn.dt_bias", "{layer}self_attention.kda.dt_bias", ("kda_dim",), attn=KDA, dtypes=F32_STATE,
           native="{layer}self_attention.dt_bias", role=R.KDA_DT_BIAS),
        _r("{layer}self_attn.o_norm.weight", "{layer}self_attention.kda.o_norm.weight", ("kda_head",), attn=KDA,
           native="{layer}self_attention.o_norm.weight", role=R.KDA_O_NORM),
    ]
    return rules


def _dsa() -> list[Rule]:
    """NoPE MLA with the kpool indexer. miles fuses the q/kv norms into the up projections and keeps the indexer
    on the attention module; megatron-core's DSA has separate norms and an `indexer` under `core_attention`,
    and no parameter for the kpool compression (kept, homeless)."""
    a, m, ix = "{layer}self_attn.", "{layer}self_attention.", "{layer}self_attention.core_attention.indexer."
    return [
        _r(a + "q_a_proj.weight", m + "linear_q_down_proj.weight", ("q_lora", "hidden"), attn=DSA, fp8=True,
           extra_state=True, role=R.DSA_Q_A),
        _r(a + "q_a_layernorm.weight", m + "linear_q_up_proj.layer_norm_weight", ("q_lora",), attn=DSA,
           native=Home((m + "q_layernorm.weight",), extra_state=True), role=R.DSA_Q_A_NORM),
        _r(a + "q_b_proj.weight", m + "linear_q_up_proj.weight", ("mla_q", "q_lora"), attn=DSA, fp8=True,
           extra_state=True, role=R.DSA_Q_B),
        _r(a + "kv_a_proj_with_mqa.weight", m + "linear_kv_down_proj.weight", ("mla_kv_a", "hidden"), attn=DSA,
           fp8=True, extra_state=True, role=R.DSA_KV_A),
        _r(a + "kv_a_layernorm.weight", m + "linear_kv_up_proj.layer_norm_weight", ("kv_lora",), attn=DSA,
           native=Home((m + "kv_layernorm.weight",), extra_state=True), role=R.DSA_KV_A_NORM),
        _r(a + "kv_b_proj.weight", m + "linear_kv_up_proj.weight", ("mla_kv_b", "kv_lora"), attn=DSA,
           extra_state=True, role=R.DSA_KV_B),
        _r(a + "o_proj.weight", m + "linear_proj.weight", ("hidden", "mla_o"), attn=DSA, fp8=True, extra_state=True,
           role=R.DSA_O_PROJ),
        _r(a + "indexer.wq_b.weight", m + "wq_b.weight", ("idx_q", "q_lora"), attn=DSA, indexer=True,
           native=ix + "linear_wq_b.weight", extra_state=True, role=R.INDEXER_WQ_B),
        _r(a + "indexer.wk.weight", m + "wk.weight", ("idx_dim", "hidden"), attn=DSA, indexer=True,
           native=ix + "linear_wk.weight", extra_state=True, role=R.INDEXER_WK),
        _r(a + "indexer.k_norm.weight", m + "k_norm.weight", ("idx_dim",), attn=DSA, indexer=True,
           native=ix + "k_norm.weight", extra_state=True, role=R.INDEXER_K_NORM_WEIGHT),
        _r(a + "indexer.k_norm.bias", m + "k_norm.bias", ("idx_dim",), attn=DSA, indexer=True,
           native=ix + "k_norm.bias", role=R.INDEXER_K_NORM_BIAS),
        _r(a + "indexer.weights_proj.weight", m + "weights_proj.weight", ("idx_heads", "hidden"), attn=DSA,
           indexer=True, native=ix + "linear_weights_proj.weight", extra_state=True, role=R.INDEXER_WEIGHTS_PROJ),
        _r(a + "indexer.index_kpool_compress_gate", m + "index_kpool_compress_gate", ("idx_dim", "hidden"),
           attn=DSA, indexer=True, native=Home((ix + "index_kpool_compress_gate",), homeless=True),
           role=R.INDEXER_COMPRESS_GATE),
        _r(a + "indexer.index_kpool_compress_ape", m + "index_kpool_compress_ape", ("kpool", "idx_dim"),
           attn=DSA, indexer=True, dtypes=F32_STATE_BF16_RELEASE,
           native=Home((ix + "index_kpool_compress_ape",), homeless=True), role=R.INDEXER_COMPRESS_APE),
    ]


def _mlp() -> list[Rule]:
    h, m = "{layer}mlp.", "{layer}mlp."
    gate_up = names.SWIGLU_GATE_UP
    return [
        _r("{layer}post_attention_layernorm.weight", m + "linear_fc1.layer_norm_weight", ("hidden",), mlp=DENSE,
           role=R.MLP_NORM),
        _r(tuple(h + p for p in gate_up), m + "linear_fc1.weight", ("inter", "hidden"), ("inter", "hidden"),
           transform=Concat(0), mlp=DENSE, fp8=True, extra_state=True, role=R.DENSE_FC1),
        _r(h + "down_proj.weight", m + "linear_fc2.weight", ("hidden", "inter"), mlp=DENSE, fp8=True, extra_state=True,
           role=R.DENSE_FC2),
        _r("{layer}post_attention_layernorm.weight", "{layer}pre_mlp_layernorm.weight", ("hidden",), mlp=MOE,
           extra_state=True, role=R.MLP_NORM),
        _r(h + "gate.weight", m + "router.weight", ("experts", "hidden"), mlp=MOE, role=R.MOE_ROUTER),
        _r(h + "gate.e_score_correction_bias", m + "router.expert_bias", ("experts",), mlp=MOE, dtypes=F32_STATE,
           role=R.MOE_EXPERT_BIAS),
        _r(tuple(h + "shared_experts." + p for p in gate_up), m + "shared_experts.linear_fc1.weight",
           ("shared_inter", "hidden"), ("shared_inter", "hidden"), transform=Concat(0), mlp=MOE, fp8=True,
           needs_shared_experts=True, extra_state=True, role=R.MOE_SHARED_FC1),
        _r(h + "shared_experts.down_proj.weight", m + "shared_experts.linear_fc2.weight", ("hidden", "shared_inter"),
           mlp=MOE, fp8=True, needs_shared_experts=True, extra_state=True, role=R.MOE_SHARED_FC2),
        _r(tuple(h + "experts.{e}." + p for p in gate_up), m + "experts.experts.linear_fc1.weight",
           ("moe_inter", "hidden"), ("moe_inter", "hidden"), transform=StackExperts(parts=2), mlp=MOE, fp8=True,
           per_expert=True, extra_state=True, role=R.MOE_EXPERTS_FC1),
        _r(h + "experts.{e}.down_proj.weight", m + "experts.experts.linear_fc2.weight", ("hidden", "moe_inter"),
           transform=StackExperts(parts=1), mlp=MOE, fp8=True, per_expert=True, extra_state=True,
           role=R.MOE_EXPERTS_FC2),
    ]


def _layer() -> list[Rule]:
    return [
        _r("{layer}input_layernorm.weight", "{layer}input_layernorm.weight", ("hidden",), extra_state=True,
           role=R.ATTN_NORM),
        *_hc("attn", "self_attention"), *_hc("ffn", "mlp"), *_kda(), *_dsa(), *_mlp(),
    ]


def _global() -> list[Rule]:
    return [
        _r("{text}embed_tokens.weight", "embedding.word_embeddings.weight", ("vocab", "hidden"), scope=GLOBAL,
           role=R.EMBED),
        _r("{text}norm.weight", "decoder.final_layernorm.weight", ("hidden",), scope=GLOBAL, extra_state=True,
           role=R.FINAL_NORM),
        # no extra_state: GPTModel.sharded_state_dict drops output_layer._extra_state (gpt_model.py)
        _r("lm_head.weight", "output_layer.weight", ("vocab", "hidden"), scope=GLOBAL, role=R.LM_HEAD),
    ]


def _mtp() -> list[Rule]:
    """The MTP layer's own tensors; its decoder layer (DSA + MoE, no hc) uses the layer rules."""
    return [
        _r("{layer}enorm.weight", "{mtp}enorm.weight", ("hidden",), scope=MTP, extra_state=True, role=R.MTP_ENORM),
        _r("{layer}hnorm.weight", "{mtp}hnorm.weight", ("hidden",), scope=MTP, extra_state=True, role=R.MTP_HNORM),
        _r("{layer}eh_proj.weight", "{mtp}eh_proj.weight", ("hidden", "eh_in"), scope=MTP, extra_state=True,
           role=R.MTP_EH_PROJ),
        _r("{layer}shared_head.norm.weight", "{mtp}final_layernorm.weight", ("hidden",), scope=MTP,
           extra_state=True, role=R.MTP_FINAL_NORM),
    ]


def _vision() -> list[Rule]:
    """Vision tower: pass-through, stored in Megatron under `vision_model.` so export restores it."""
    tensors: list[tuple[str, tuple[str | int, ...]]] = [
        ("patch_embed.proj.weight", ("v_hidden", "v_in", "v_tpatch", "v_patch", "v_patch")),
        ("patch_embed.proj.bias", ("v_hidden",)),
        ("post_layernorm.weight", ("v_hidden",)),
        ("downsample.weight", ("v_out", "v_hidden", "v_merge", "v_merge")),
        ("downsample.bias", ("v_out",)),
        ("merger.proj.weight", ("v_out", "v_out")),
        ("merger.post_projection_norm.weight", ("v_out",)),
        ("merger.post_projection_norm.bias", ("v_out",)),
        ("merger.gate_proj.weight", ("v_proj_inter", "v_out")),
        ("merger.up_proj.weight", ("v_proj_inter", "v_out")),
        ("merger.down_proj.weight", ("v_out", "v_proj_inter")),
    ]
    block: list[tuple[str, tuple[str | int, ...]]] = [
        ("norm1.weight", ("v_hidden",)), ("norm2.weight", ("v_hidden",)),
        ("attn.qkv.weight", ("v_qkv", "v_hidden")), ("attn.qkv.bias", ("v_qkv",)),
        ("attn.proj.weight", ("v_hidden", "v_hidden")), ("attn.proj.bias", ("v_hidden",)),
        ("attn.q_norm.weight", ("v_head",)), ("attn.k_norm.weight", ("v_head",)),
        ("mlp.gate_proj.weight", ("v_inter", "v_hidden")), ("mlp.gate_proj.bias", ("v_inter",)),
        ("mlp.up_proj.weight", ("v_inter", "v_hidden")), ("mlp.up_proj.bias", ("v_inter",)),
        ("mlp.down_proj.weight", ("v_hidden", "v_inter")), ("mlp.down_proj.bias", ("v_hidden",)),
    ]
    rules = [_r("{visual}" + n, "vision_model." + n, s, scope=VISION, role=_vision_role(n)) for n, s in tensors]
    rules += [_r("{visual}blocks.{b}." + n, "vision_model.blocks.{b}." + n, s, scope=VISION, per_block=True,
                 role=_vision_role(n)) for n, s in block]
    return rules


def _vision_role(name: str) -> str:
    if name.endswith(".bias"):
        return R.VISION_BIAS
    return R.VISION_NORM if re.search(r"norm\d?\.weight$", name) else R.VISION_MATRIX


RULES: tuple[Rule, ...] = (*_global(), *_layer(), *_mtp(), *_vision())  # the miles layout's


@cache
def rules_in(name: str = DEFAULT_LAYOUT) -> tuple[Rule, ...]:
    """The table as layout `name` lays it out (the same rules, in the same order)."""
    return tuple(r.in_layout(name) for r in RULES)
