"""The Megatron-LM model arguments of a GLM-5.3-Flash config, the common state built from them, and the check of
a checkpoint's stored `args`.

One source: `build_args` (what convert stores in the common state) plus the few model switches a launcher
passes that the stored args do not carry. A training launch whose arguments disagree with the checkpoint loads
the wrong shapes or silently re-initialises; a torch_dist checkpoint whose stored args disagree with its
config.json is refused before any tensor is read.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import types
from typing import Any

from glmconv.config import MOE, GlmConfig
from glmconv.defaults import DEFAULT_LAYOUT
from glmconv.errors import CheckpointError
from glmconv.io.torch_dist.common_state import short_repr
from glmconv.io.torch_dist.metadata import TORCH_DIST
from glmconv.rules.layouts import MTP_PART
from glmconv.rules.layouts import layout as find_layout

CHECKPOINT_VERSION = 3.0
VOCAB_DIVISOR = 128
GLMCONV_ENTRY = "glmconv"  # the common state's record of what glmconv wrote (its Megatron layout)


def build_args(config: GlmConfig, *, padded_vocab_size: int | None = None, **overrides: Any) -> argparse.Namespace:
    """The model args a Megatron trainer reads back from `state_dict['args']` (checks, --use-checkpoint-args)."""
    t = config.text
    shared = t["moe_intermediate_size"] * t["n_shared_experts"]
    args: dict[str, Any] = dict(
        num_layers=config.num_layers, hidden_size=t["hidden_size"], ffn_hidden_size=t["intermediate_size"],
        num_attention_heads=t["num_attention_heads"], normalization="RMSNorm", layernorm_epsilon=t["rms_norm_eps"],
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
        position_embedding_type="none", add_position_embedding=False,
        max_position_embeddings=t.get("max_position_embeddings"),
        vocab_size=t["vocab_size"], padded_vocab_size=padded_vocab_size or t["vocab_size"],
        make_vocab_size_divisible_by=VOCAB_DIVISOR, tokenizer_type="HuggingFaceTokenizer",
        multi_latent_attention=True, q_lora_rank=t["q_lora_rank"], kv_lora_rank=t["kv_lora_rank"],
        qk_head_dim=t["qk_nope_head_dim"], qk_pos_emb_head_dim=t["qk_rope_head_dim"], v_head_dim=t["v_head_dim"],
        num_experts=t["n_routed_experts"], moe_ffn_hidden_size=t["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=shared or None, moe_router_topk=t["num_experts_per_tok"],
        moe_layer_freq=[int(m == MOE) for m in config.mlp_types], moe_router_enable_expert_bias=True,
        moe_router_score_function=t.get("scoring_func", "sigmoid"),
        moe_router_topk_scaling_factor=t.get("routed_scaling_factor"),
        mtp_num_layers=config.num_mtp_layers or None,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        bf16=True, ckpt_format=TORCH_DIST, no_save_optim=True, no_save_rng=True,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def build_common_state(config: GlmConfig, *, iteration: int = 0, padded_vocab_size: int | None = None,
                       content_metadata: dict[str, Any] | None = None, layout: str | None = None,
                       **arg_overrides: Any) -> dict[str, Any]:
    """`args`, `checkpoint_version` 3.0 and `iteration`; `content_metadata` only when the caller has one; with
    `layout`, a `glmconv` entry recording it (a trainer ignores keys it does not know).

    Without `content_metadata` a trainer uses its own sharding metadata (e.g. singleton_local_shards). In a
    layout whose trainer has no MTP module the args say so (`mtp_num_layers` None): the MTP tensors are kept only.
    """
    if layout is not None:
        arg_overrides.setdefault("mtp_num_layers", mtp_num_layers(config, layout))
    state: dict[str, Any] = {
        "args": build_args(config, padded_vocab_size=padded_vocab_size, **arg_overrides),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    if layout is not None:
        state[GLMCONV_ENTRY] = {"layout": layout}
    if content_metadata is not None:
        state["content_metadata"] = dict(content_metadata)
    return state


def mtp_num_layers(config: GlmConfig, layout: str) -> int | None:
    """`args.mtp_num_layers` in a layout: None where its trainer has no MTP module (the MTP tensors are kept only)."""

    return None if MTP_PART in find_layout(layout).homeless_parts else config.num_mtp_layers or None


def relaid_common_state(common: dict[str, Any], config: GlmConfig, layout: str) -> dict[str, Any]:
    """A checkpoint's common state for `layout` (relayout): its own `args`, iteration and the rest kept, with the
    layout's `mtp_num_layers` rule and `glmconv` entry, as `build_common_state` writes them.

    Megatron objects the reader keeps as inert stand-ins (`OpaqueValue`) are carried as they are: the writer
    pickles them back as the globals they stand for (`pickle_module_for`)."""
    state = dict(common)
    args = state.get("args")
    if isinstance(args, argparse.Namespace | types.SimpleNamespace):
        args = copy.copy(args)
        args.mtp_num_layers = mtp_num_layers(config, layout)
        state["args"] = args
    entry = state.get(GLMCONV_ENTRY)
    state[GLMCONV_ENTRY] = {**(entry if isinstance(entry, dict) else {}), "layout": layout}
    return state


# (args attribute, Megatron-LM flag): store_true flags print bare, in this order (model shape first)
_FLAGS: tuple[tuple[str, str], ...] = (
    ("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"), ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"), ("normalization", "--normalization"),
    ("layernorm_epsilon", "--norm-epsilon"), ("swiglu", "--swiglu"),
    ("activation_func_clamp_value", "--activation-func-clamp-value"),
    ("disable_bias_linear", "--disable-bias-linear"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("position_embedding_type", "--position-embedding-type"),
    ("max_position_embeddings", "--max-position-embeddings"), ("vocab_size", "--vocab-size"),
    ("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by"),
    ("multi_latent_attention", "--multi-latent-attention"), ("q_lora_rank", "--q-lora-rank"),
    ("kv_lora_rank", "--kv-lora-rank"), ("qk_head_dim", "--qk-head-dim"),
    ("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim"), ("v_head_dim", "--v-head-dim"),
    ("dsa_indexer_n_heads", "--dsa-indexer-n-heads"), ("dsa_indexer_head_dim", "--dsa-indexer-head-dim"),
    ("dsa_indexer_topk", "--dsa-indexer-topk"),
    ("num_experts", "--num-experts"), ("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
    ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
    ("moe_router_topk", "--moe-router-topk"), ("moe_layer_freq", "--moe-layer-freq"),
    ("moe_router_score_function", "--moe-router-score-function"),
    ("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"),
    ("moe_router_dtype", "--moe-router-dtype"), ("mtp_num_layers", "--mtp-num-layers"),
)

# what a stored `args` must agree on with the config, and how to say it
_CHECKED = (("num_layers", "decoder layers"), ("hidden_size", "hidden size"), ("num_experts", "routed experts"),
            ("dense_layers", "leading dense layers"), ("vocab_size", "vocabulary"))


def model_args(config: GlmConfig, layout: str = DEFAULT_LAYOUT) -> dict[str, Any]:
    """Megatron-LM flag -> value for `config` (True for a bare switch); flags that do not apply are left out.

    `layout`: the Megatron layout trained; one whose trainer has no MTP module (mcore) gets no --mtp-num-layers,
    as its checkpoints' stored args say."""

    t = config.text
    values = vars(build_args(config, mtp_num_layers=mtp_num_layers(config, layout)))
    values.update(
        disable_bias_linear=not values["add_bias_linear"],
        activation_func_clamp_value=float(t.get("swiglu_limit", 10.0)),
        moe_router_dtype="fp32" if t.get("moe_router_dtype", "float32") in ("float32", "fp32") else None,
        dsa_indexer_n_heads=t.get("index_n_heads"), dsa_indexer_head_dim=t.get("index_head_dim"),
        dsa_indexer_topk=t.get("index_topk"), moe_layer_freq=layer_pattern(values["moe_layer_freq"]),
    )
    if not any(m == MOE for m in config.mlp_types):
        for attr in [a for a, _ in _FLAGS if a.startswith("moe_") or a == "num_experts"]:
            values[attr] = None
    return {flag: values[attr] for attr, flag in _FLAGS if values.get(attr) is not None and values[attr] is not False}


def layer_pattern(freq: list[int]) -> str:
    """[0, 0, 0, 1, 1, ...] as Megatron's run-length pattern "([0]*3+[1]*42)" (what --moe-layer-freq parses)."""
    runs: list[list[int]] = []
    for v in freq:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "(" + "+".join(f"[{v}]*{n}" for v, n in runs) + ")"


def command_line(args: dict[str, Any]) -> list[str]:
    """The flags as shell words for a launcher, one flag per line (`--flag value`, bare for a switch)."""

    return [flag if value is True else f"{flag} {shlex.quote(str(value))}" for flag, value in args.items()]


def check_stored_args(args: Any, config: GlmConfig, where: str) -> None:
    """Refuse a checkpoint whose stored `args` describe another model than its config (experts, layers, ...)."""
    stored = args if isinstance(args, dict) else getattr(args, "__dict__", None)
    if not isinstance(stored, dict):
        return  # no args, or an opaque object: nothing to compare (the config is then the only description)
    want = {"num_layers": config.num_layers, "hidden_size": config.dim("hidden_size"),
            "num_experts": config.dim("n_routed_experts"), "dense_layers": _dense(config.mlp_types),
            "vocab_size": config.dim("vocab_size")}
    have = dict(stored)
    freq = have.get("moe_layer_freq")
    if isinstance(freq, list) and all(isinstance(f, int) for f in freq):  # 0/1 per layer, as megatron parses it
        have["dense_layers"] = _dense([MOE if f else "dense" for f in freq])
    for key, what in _CHECKED:
        if key in have and have[key] is not None and not _equal(have[key], want[key]):
            raise CheckpointError(f"{where}: the stored Megatron args say {short_repr(have[key])} {what} ({key}) but "
                                  f"the config says {want[key]}: this checkpoint is another model than its config.json")


def _equal(stored: Any, expected: int) -> bool:
    """A stored arg (any value a checkpoint holds: an array, a set, a stand-in) equals the config's int."""
    try:
        return bool(stored == expected)
    except Exception:  # an array's ambiguous truth, a comparison that raises: not the config's value
        return False


def _dense(mlp_types: Any) -> int:
    """Leading dense MLP layers (`first_k_dense_replace`)."""
    n = 0
    for kind in mlp_types:
        if kind == MOE:
            break
        n += 1
    return n
