"""The mcore layout's DSA attention keys are those of megatron-core's own DSA module, as it saves them.

One gloo process on CPU builds megatron-core 0.19.2's experimental DSA attention (`get_dsa_module_spec_for_backend`:
AbsorbedMLASelfAttention with DSAttention and its DSAIndexer, the module Megatron-Bridge's GLM-5.3-Flash spec
uses for the DSA layers) for the `tiny` fixture's dimensions and records its `sharded_state_dict()`: every
ShardedTensor key with its global shape and every ShardedObject (`_extra_state`) key. That must be exactly what
the mcore-layout plan has for a DSA layer's attention, less the kpool compression the module has no parameter
for (kept by glmconv under `glmconv_kept.`).

Stand-ins, because Transformer Engine is not installed: the spec asks the backend for TE's duplicated
`TELinear` (indexer projections, q/kv down projections); a local linear takes its place, which saves the same
`weight` and `_extra_state` keys; its norms (q/kv layernorm, the indexer's k_norm) are TE's `TENorm`, which saves
an `_extra_state` beside its weights: the local norm wrapped to do the same. Core attention needs no stand-in.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import mcore_helpers as mh

from glmconv.config import parse_config
from glmconv.fixtures import preset_config
from glmconv.plan import Plan, build_plan

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PREFIX = "decoder.layers.{}.self_attention."


def _dsa_module(text: dict[str, Any]) -> Any:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class Duplicated(ColumnParallelLinear):  # TELinear(parallel_mode="duplicated") at TP 1: one whole weight
        def __init__(self, *args: Any, parallel_mode: str | None = None, **kw: Any) -> None:
            super().__init__(*args, gather_output=False, **kw)

    class Backend(LocalSpecProvider):
        def linear(self) -> type:
            return Duplicated

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return mh.te_norm(super().layer_norm(rms_norm=rms_norm, for_qk=for_qk))

    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=text["hidden_size"], num_attention_heads=text["num_attention_heads"],
        ffn_hidden_size=text["intermediate_size"], multi_latent_attention=True, q_lora_rank=text["q_lora_rank"],
        kv_lora_rank=text["kv_lora_rank"], qk_head_dim=text["qk_nope_head_dim"],
        qk_pos_emb_head_dim=text["qk_rope_head_dim"], v_head_dim=text["v_head_dim"], qk_layernorm=True,
        rope_type="rope", normalization="RMSNorm", add_bias_linear=False, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=text["index_n_heads"], dsa_indexer_head_dim=text["index_head_dim"],
        dsa_indexer_topk=text["index_topk"], use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.bfloat16)
    spec = get_dsa_module_spec_for_backend(cfg, Backend())
    spec.submodules.linear_q_down_proj = spec.submodules.linear_kv_down_proj = ColumnParallelLinear  # local MLA
    return build_module(spec, config=cfg, layer_number=1)


def _inventory_worker(rank: int, text: dict[str, Any], layer: int, out: str) -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # RotaryEmbedding's device query
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    parallel_state.initialize_model_parallel(1, 1)
    sd = _dsa_module(text).sharded_state_dict(prefix=PREFIX.format(layer))
    apply_factories(sd)
    values = list(nested_values(sd))
    torch.save({"tensors": {v.key: tuple(v.global_shape) for v in values if isinstance(v, ShardedTensor)},
                "objects": sorted(v.unique_key for v in values if isinstance(v, ShardedObject))}, out)


@pytest.fixture(scope="module")
def tiny() -> tuple[Plan, int]:
    cfg = parse_config(preset_config("tiny"))
    return build_plan(cfg, layout="mcore"), cfg.attn_types.index("dsa")


@pytest.fixture(scope="module")
def megatron(tiny: tuple[Plan, int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("dsa") / "inventory"
    mh.spawn(_inventory_worker, preset_config("tiny")["text_config"], tiny[1], str(out), nprocs=1)
    return torch.load(out, weights_only=True)


def test_dsa_attention_keys_and_shapes_equal_megatron_cores_module(tiny: tuple[Plan, int],
                                                                   megatron: dict[str, Any]) -> None:
    plan, layer = tiny
    mine = {n: t.shape for n, t in plan.mcore_index.items() if n.startswith(PREFIX.format(layer))}
    assert mine == megatron["tensors"]


def test_dsa_attention_extra_state_objects_equal_megatron_cores_module(tiny: tuple[Plan, int],
                                                                       megatron: dict[str, Any]) -> None:
    plan, layer = tiny
    assert sorted(k for k in plan.mcore_objects() if k.startswith(PREFIX.format(layer))) == megatron["objects"]


def test_the_kpool_compression_is_the_only_indexer_tensor_without_a_parameter(tiny: tuple[Plan, int],
                                                                             megatron: dict[str, Any]) -> None:
    plan, layer = tiny
    kept = [t.name for m in plan.homeless() if m.layer == layer for t in m.mcore]
    assert sorted(k.rsplit(".", 1)[1] for k in kept) == ["index_kpool_compress_ape", "index_kpool_compress_gate"]
    assert not any(k.removeprefix("glmconv_kept.") in megatron["tensors"] for k in kept)
