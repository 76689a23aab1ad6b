"""The Megatron-LM model arguments of a GLM-5.3-Flash config, and the check of a checkpoint's stored `args`.

One source: `build_args` (what convert stores in the common state) plus the few model switches a launcher
passes that the stored args do not carry. A training launch whose arguments disagree with the checkpoint loads
the wrong shapes or silently re-initialises; a torch_dist checkpoint whose stored args disagree with its
config.json is refused before any tensor is read.
"""

from __future__ import annotations

import shlex
from typing import Any

from glmconv.config import MOE, GlmConfig
from glmconv.errors import CheckpointError
from glmconv.io.torch_dist.common_state import build_args, mtp_num_layers

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


def model_args(config: GlmConfig, layout: str = "miles") -> dict[str, Any]:
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
    if isinstance(have.get("moe_layer_freq"), list):
        have["dense_layers"] = _dense([MOE if f else "dense" for f in have["moe_layer_freq"]])
    for key, what in _CHECKED:
        if key in have and have[key] is not None and have[key] != want[key]:
            raise CheckpointError(f"{where}: the stored Megatron args say {have[key]} {what} ({key}) but the config "
                                  f"says {want[key]}: this checkpoint is another model than its config.json")


def _dense(mlp_types: Any) -> int:
    """Leading dense MLP layers (`first_k_dense_replace`)."""
    n = 0
    for kind in mlp_types:
        if kind == MOE:
            break
        n += 1
    return n
