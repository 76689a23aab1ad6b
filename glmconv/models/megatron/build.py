"""megatron-core's own DSA attention and MoE modules for a GLM config, built the way a trainer builds them: its
MLATransformerConfig from the values `glmconv megatron-args` prints, and the spec functions Megatron-Bridge's
GLM-5.3 layer spec calls (`get_dsa_module_spec_for_backend`, `get_moe_module_spec_for_backend`).

Transformer Engine is not needed: the spec is asked of megatron-core's local backend with TE's duplicated linear
and TENorm stood in (glmconv.models.megatron.standins), which save the same keys. On a CPU everything runs
megatron-core's unfused torch path; the DSA core attention is megatron-core's own module either way ("TE does not
support sparse attention yet", experimental_attention_variant_module_specs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from glmconv.config import GlmConfig
from glmconv.megatron_args import build_args, model_args
from glmconv.models.megatron import standins

if TYPE_CHECKING:
    import torch

# Megatron-LM argument -> TransformerConfig field, where the names differ (megatron/training/arguments.py's
# core_transformer_config_from_args does the same renames)
_RENAMED = {"num_experts": "num_moe_experts", "swiglu": "gated_linear_unit"}
_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "normalization", "layernorm_epsilon",
           "add_bias_linear", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
           "moe_ffn_hidden_size", "moe_router_topk", "moe_router_enable_expert_bias", "moe_router_score_function",
           "moe_router_topk_scaling_factor", "multi_latent_attention", "moe_shared_expert_intermediate_size")
# the flags megatron-args prints beyond the stored args, and their TransformerConfig fields
_FLAGS = {"--activation-func-clamp-value": "activation_func_clamp_value",
          "--dsa-indexer-n-heads": "dsa_indexer_n_heads", "--dsa-indexer-head-dim": "dsa_indexer_head_dim",
          "--dsa-indexer-topk": "dsa_indexer_topk", "--moe-router-dtype": "moe_router_dtype"}


BIAS_SWIGLU_FUSION = True  # Megatron-LM's --bias-swiglu-fusion default (megatron/training/arguments.py)


def config_values(config: GlmConfig) -> dict[str, Any]:
    """The TransformerConfig fields a trainer launched with `glmconv megatron-args`' flags gets (model shape only)."""
    import torch.nn.functional as F

    args = vars(build_args(config))
    values = {f: args[f] for f in _FIELDS}
    for arg, field_name in _RENAMED.items():
        values[field_name] = args[arg]
    flags = model_args(config)
    values.update({field_name: flags[flag] for flag, field_name in _FLAGS.items() if flag in flags})
    values["activation_func"] = F.silu  # --swiglu
    return values


def transformer_config(config: GlmConfig, dtype: torch.dtype, rotate: bool = True) -> Any:
    """megatron-core's MLATransformerConfig of `config` on the current parallel state, CPU-initialised in `dtype`.

    The DSA switches not in megatron-args are megatron-core's defaults (rotate_activation, scoring_relu, the
    indexer k-norm eps = layernorm_epsilon); `rotate` False only where megatron-core cannot run the rotation
    (fp32: rotate_activation asserts bf16). The one Megatron-LM default of a flag megatron-args does not print that
    changes these modules' numbers is set as a launch gets it: `bias_activation_fusion` = `--bias-swiglu-fusion`
    (on unless `--no-bias-swiglu-fusion`; megatron/training/argument_utils.py core_transformer_config_from_args)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    return MLATransformerConfig(
        **config_values(config), qk_layernorm=True, rope_type="rope", experimental_attention_variant="dsa",
        dsa_indexer_rotate_activation=rotate, bias_activation_fusion=BIAS_SWIGLU_FUSION,
        use_cpu_initialization=True, perform_initialization=False,
        params_dtype=dtype, bf16=dtype.is_floating_point and str(dtype) == "torch.bfloat16",
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        moe_token_dispatcher_type="allgather")


def dsa_attention(cfg: Any, layer: int) -> Any:
    """AbsorbedMLASelfAttention with DSAttention and its DSAIndexer, from megatron-core's DSA spec function."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import build_module

    spec = get_dsa_module_spec_for_backend(cfg, _backend())
    # absorbed_mla.py takes a duplicated q/kv down projection only from a class that *is* TELinear (None without
    # TE); megatron-core's column-parallel one (gathered back to the whole latent) is its local equivalent
    spec.submodules.linear_q_down_proj = spec.submodules.linear_kv_down_proj = ColumnParallelLinear
    return build_module(spec, config=cfg, layer_number=layer + 1)


def moe_layer(cfg: Any, layer: int) -> Any:
    """MoELayer (TopKRouter, SequentialMLP experts, the shared expert) from megatron-core's MoE spec function."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    build = get_moe_module_spec_for_backend(_backend(), num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    return build(config=cfg, layer_number=layer + 1)


def class_names(cfg: Any) -> tuple[str, str]:
    """The classes `dsa_attention` and `moe_layer` build, read from the same specs ("Module+CoreAttention", "MoE")."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    dsa = get_dsa_module_spec_for_backend(cfg, _backend())
    moe = get_moe_module_spec_for_backend(_backend(), num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    return f"{dsa.module.__name__}+{dsa.submodules.core_attention.module.__name__}", moe.func.__name__


def _backend() -> Any:
    """megatron-core's local backend with TE's duplicated linear and TENorm stood in (what the TE backend gives the
    DSA spec; the linears TE column/row-parallel-izes are megatron-core's own Column/RowParallelLinear)."""
    from megatron.core.models.backends import LocalSpecProvider

    class Backend(LocalSpecProvider):  # type: ignore[misc]  # megatron-core is untyped
        def linear(self) -> type:
            return standins.te_linear()

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> Any:
            return standins.te_norm(super().layer_norm(rms_norm=rms_norm, for_qk=for_qk))

    return Backend()
