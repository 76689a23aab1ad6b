"""glmconv's Megatron names and shapes against the modules megatron-core itself builds.

One group of 2 gloo processes on CPU builds megatron-core 0.19.2's `GPTModel` for a config equivalent to the
`tiny` fixture (4 layers, MLA everywhere, dense MLP at 0-1, MoE at 2-3 with 8 SequentialMLP experts, a shared
expert and the router's expert bias, untied output layer, RMSNorm, one MTP layer) from the LOCAL (non-TE)
layer specs, at TP=2 and EP=2 (ETP=1), and records its `sharded_state_dict()`: every ShardedTensor's key,
global shape and this rank's piece, and every ShardedObject key. The tests compare that with glmconv's plan
(`plan.mcore_index`, `plan.mcore_objects()`) and with the shard layouts the load proofs request
(`mcore_helpers.shard_pieces`: the shard kind of each tensor's role and transform, in the plan).

What is compared: embedding, output layer, final norm; per layer the input norm, the MLA projections of the
DSA layer (3), the dense MLPs (0, 1), the MoE router / experts / shared experts (2, 3); the MTP block.
What megatron-core cannot build, and what stands in:
- KDA attention, the DSA indexer (`wq_b`, `wk`, `k_norm`, `weights_proj`, `index_kpool_compress_*`), the
  hyper-connections and the vision tower are miles modules, not megatron-core ones (megatron-core's own DSA
  indexer is named `linear_wq_b`/`linear_wk`/...): their names are left to the load proofs.
- Transformer Engine is not installed (CPU), so the local spec is built, its norms wrapped to save an
  `_extra_state` as TE's TENorm does (`mcore_helpers.te_norm`). It keeps q/kv layernorms and the dense
  MLP's pre-MLP norm as separate modules where the TE spec fuses them into `linear_q_up_proj`,
  `linear_kv_up_proj` and `linear_fc1` (`layer_norm_weight`): the layer specs get the
  `sharded_state_dict_keys_map` that says so, as megatron-core's own local GPT spec does for its fused norms.
- megatron-core 0.19.2's MLA passes `k_channels`/`v_channels` to its core attention, which the local
  `DotProductAttention` does not accept (only TE's does): core attention is replaced by `IdentityOp`. The local
  one has no parameters and no extra state (TE's DotProductAttention would ask for a `core_attention._extra_state`
  object, which glmconv does not write; whether the GLM-5.3 trainer's DSA core attention is TE's is not known here).
- MLA's rotary embedding asks `torch.cuda.current_device()` even with `use_cpu_initialization`; the workers
  answer "cpu" (it only places the non-persistent `inv_freq`).
- The local spec's `linear_q_down_proj` / `linear_kv_down_proj` are ColumnParallelLinear (TP-split), where the
  TE spec uses duplicated TELinear: the layout check uses `down_proj="column"` for them. Global shapes agree.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from helpers import mcore_helpers as mh

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
NOT_IN_MEGATRON_CORE = re.compile(r"_hyper_connection\.|\.kda\.|\.self_attention\.(wq_b|wk|k_norm|weights_proj|"
                                  r"index_kpool_compress_)|^vision_model\.")
FUSED_NORMS = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
               "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
DENSE_FUSED_NORM = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _tiny_plan() -> Any:
    from glmconv.config import parse_config
    from glmconv.fixtures import preset_config
    from glmconv.plan import build_plan

    return build_plan(parse_config(preset_config("tiny")))


def _all_mla_plan() -> Any:
    """The tiny plan with every layer DSA (MLA), as megatron-core's model is built: a mapping for each key it has."""
    from glmconv.config import parse_config
    from glmconv.fixtures import preset_config
    from glmconv.plan import build_plan

    cfg = preset_config("tiny")
    text = cfg["text_config"]
    n = text["num_hidden_layers"]
    text["layer_types"] = ["deepseek_sparse_attention"] * n
    text["linear_attn_config"].update(kda_layers=[], full_attn_layers=list(range(n)))
    return build_plan(parse_config(cfg))


def _megatron_model(text: dict[str, Any]) -> Any:
    """megatron-core's GPTModel (local spec) for the tiny text config; every layer MLA."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dense = [t == "dense" for t in text["mlp_layer_types"]]
    cfg = MLATransformerConfig(
        num_layers=text["num_hidden_layers"], hidden_size=text["hidden_size"],
        num_attention_heads=text["num_attention_heads"], ffn_hidden_size=text["intermediate_size"],
        multi_latent_attention=True, q_lora_rank=text["q_lora_rank"], kv_lora_rank=text["kv_lora_rank"],
        qk_head_dim=text["qk_nope_head_dim"], qk_pos_emb_head_dim=text["qk_rope_head_dim"],
        v_head_dim=text["v_head_dim"], qk_layernorm=True, rope_type="rope",
        num_moe_experts=text["n_routed_experts"], moe_ffn_hidden_size=text["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=text["moe_intermediate_size"] * text["n_shared_experts"],
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
        moe_router_topk=text["num_experts_per_tok"], moe_layer_freq=[0 if d else 1 for d in dense],
        gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm",
        mtp_num_layers=text["num_nextn_predict_layers"], tensor_model_parallel_size=2,
        expert_model_parallel_size=2, expert_tensor_parallel_size=1,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.bfloat16)
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    specs = []
    for spec, is_dense in zip(block.layer_specs, dense):
        spec = copy.deepcopy(spec)
        sub = spec.submodules
        sub.self_attention.submodules.core_attention = IdentityOp
        sub.sharded_state_dict_keys_map = {**FUSED_NORMS, **(DENSE_FUSED_NORM if is_dense else {})}
        sub.input_layernorm = mh.te_norm(sub.input_layernorm)  # TE's TENorm: the norms a TE spec keeps apart
        if not is_dense:  # a dense layer's pre-MLP norm is fused into TE's linear_fc1, whose extra state it shares
            sub.pre_mlp_layernorm = mh.te_norm(sub.pre_mlp_layernorm)
        specs.append(spec)
    block.layer_specs = specs
    block.layer_norm = mh.te_norm(block.layer_norm)
    mtp = get_gpt_mtp_block_spec(cfg, specs[-1], use_transformer_engine=False)
    for layer in mtp.layer_specs:
        for name in ("enorm", "hnorm", "layer_norm"):
            setattr(layer.submodules, name, mh.te_norm(getattr(layer.submodules, name)))
    return GPTModel(cfg, block, vocab_size=text["vocab_size"], max_sequence_length=64,
                    position_embedding_type="none", share_embeddings_and_output_weights=False, mtp_block_spec=mtp)


def _inventory_worker(rank: int, text: dict[str, Any], out: str) -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # RotaryEmbedding's device query
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                             expert_tensor_parallel_size=1)
    sd = _megatron_model(text).sharded_state_dict()
    apply_factories(sd)
    tensors: list[dict[str, Any]] = []
    objects: list[str] = []
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            tensors.append(dict(key=v.key, global_shape=tuple(v.global_shape), global_offset=tuple(v.global_offset),
                                local_shape=tuple(v.local_shape), fragments=tuple(v.axis_fragmentations),
                                main=_is_main(v.replica_id)))
        elif isinstance(v, ShardedObject):
            objects.append(v.unique_key)
        else:
            raise AssertionError(f"unexpected entry {type(v).__name__} in the sharded state dict")
    torch.save({"ranks": mh.ranks_from_parallel_state(), "tensors": tensors, "objects": objects}, f"{out}.{rank}")


def _is_main(replica_id: Any) -> bool:
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    return bool(is_main_replica(replica_id))


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Per rank: megatron-core's ShardedTensors (key, global shape, this rank's piece) and ShardedObject keys."""
    from glmconv.fixtures import preset_config

    out = tmp_path_factory.mktemp("megatron") / "inventory"
    mh.spawn(_inventory_worker, preset_config("tiny")["text_config"], str(out))
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1)]


def _shapes(megatron: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for inv in megatron:
        for t in inv["tensors"]:
            assert shapes.setdefault(t["key"], t["global_shape"]) == t["global_shape"], t["key"]
    return shapes


def _in_scope(name: str, plan: Any) -> bool:
    """A decoder/global tensor megatron-core builds the module of, on a layer whose attention it builds."""
    if name.startswith("mtp.") or NOT_IN_MEGATRON_CORE.search(name):
        return False
    layer = re.match(r"decoder\.layers\.(\d+)\.self_attention\.", name)
    return layer is None or plan.config.attn_types[int(layer.group(1))] == "dsa"


def test_decoder_and_global_keys_and_global_shapes_equal_the_plan(megatron: list[dict[str, Any]]) -> None:
    plan = _tiny_plan()
    assert tuple(plan.config.attn_types) == ("kda", "kda", "kda", "dsa")
    built = {k: s for k, s in _shapes(megatron).items() if _in_scope(k, plan)}
    planned = {n: s.shape for n, s in plan.mcore_index.items() if _in_scope(n, plan)}
    assert sorted(set(built) - set(planned)) == [] and sorted(set(planned) - set(built)) == []
    assert {k: s for k, s in built.items() if planned[k] != s} == {}
    parts = {"mla": ".self_attention.linear_", "router": ".mlp.router.", "experts": ".mlp.experts.experts.",
             "shared": ".mlp.shared_experts.", "dense": ".mlp.linear_fc", "fused norm": "layer_norm_weight"}
    assert all(sum(p in k for k in built) >= 2 for p in parts.values()), "every part is compared"
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"} <= set(built)


def test_extra_state_objects_megatron_asks_for_are_planned(megatron: list[dict[str, Any]]) -> None:
    """Without them megatron's default load fails (`Missing key ... _extra_state/shard_0_1`)."""
    plan = _tiny_plan()
    asked = {k for inv in megatron for k in inv["objects"] if _in_scope(k.split("/")[0], plan)}
    assert len(asked) > 40 and sorted(asked - set(plan.mcore_objects())) == []
    experts = [k for k in asked if k.startswith("decoder.layers.3.mlp.experts.experts.linear_fc1.")]
    assert sorted(experts) == [f"decoder.layers.3.mlp.experts.experts.linear_fc1._extra_state/shard_{e}_8"
                               for e in range(8)]


def test_no_extra_state_object_is_planned_that_megatron_does_not_ask_for(megatron: list[dict[str, Any]]) -> None:
    plan = _tiny_plan()
    asked = {k for inv in megatron for k in inv["objects"] if _in_scope(k.split("/")[0], plan)}
    assert sorted(k for k in plan.mcore_objects() if _in_scope(k.split("/")[0], plan) and k not in asked) == []


def test_mtp_block_keys_and_global_shapes_equal_the_plan(megatron: list[dict[str, Any]]) -> None:
    plan = _tiny_plan()
    built = {k: s for k, s in _shapes(megatron).items() if k.startswith("mtp.")}
    planned = {n: s.shape for n, s in plan.mcore_index.items()
               if n.startswith("mtp.") and not NOT_IN_MEGATRON_CORE.search(n)}
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight"} <= set(built) & set(planned)
    assert sorted(set(built) - set(planned)) == [] and sorted(set(planned) - set(built)) == []
    assert {k: s for k, s in built.items() if planned[k] != s} == {}
    asked = {k for inv in megatron for k in inv["objects"] if k.startswith("mtp.")}
    assert sorted(asked - set(plan.mcore_objects())) == []


def test_shard_layouts_of_the_load_proofs_are_megatrons_own(megatron: list[dict[str, Any]]) -> None:
    """Where megatron-core builds the module, `mh.shard_pieces` asks for exactly the pieces megatron does: each key
    found in the plan (every layer MLA, as built), sharded by its mapping's role and transform."""
    plan = _all_mla_plan()
    for inv in megatron:
        r: mh.Ranks = inv["ranks"]
        assert (r.tp, r.ep, r.etp) == (2, 2, 1)
        built: dict[str, set[tuple[Any, ...]]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for t in inv["tensors"]:
            built.setdefault(t["key"], set()).add((t["global_offset"], t["local_shape"], t["fragments"], t["main"]))
            shapes[t["key"]] = t["global_shape"]
        kinds = set()
        for key, pieces in built.items():
            ours = set()
            mapping, spec = plan.mapping_of_mcore[key], plan.mcore_index[key]
            assert spec.shape == shapes[key], key
            for p in mh.shard_pieces(spec, mapping, r, down_proj="column"):
                st = p.request(shapes[key], torch.bfloat16)
                ours.add((tuple(st.global_offset), tuple(st.local_shape), tuple(st.axis_fragmentations),
                          _main(st.replica_id)))
            assert ours == pieces, f"{key} at {r}: ours {sorted(ours)} != megatron's {sorted(pieces)}"
            kinds.add(mh.sharding(mapping, "column").label)  # type: ignore[union-attr]
        assert kinds == {"replicated", "column", "row", "column/2", "expert_column/2", "expert_row"}


def _main(replica_id: Any) -> bool:
    return all(x == 0 for x in replica_id) if isinstance(replica_id, tuple) else replica_id == 0


def test_both_ranks_built_the_same_model_each_with_its_own_experts(megatron: list[dict[str, Any]]) -> None:
    """Both ranks built the whole model: the same keys, each with its own experts' objects."""
    keys = [sorted({t["key"] for t in inv["tensors"]}) for inv in megatron]
    assert keys[0] == keys[1] and len(keys[0]) > 60
    fc1 = [{k for k in inv["objects"] if k.startswith("decoder.layers.2.mlp.experts.experts.linear_fc1.")}
           for inv in megatron]
    assert [len(x) for x in fc1] == [4, 4] and not fc1[0] & fc1[1]


@pytest.mark.parametrize("layout", ["miles", "mcore"])
def test_shard_kinds_come_from_roles_and_homeless_tensors_are_not_requested(layout: str) -> None:
    """Every rule's role has a shard kind; the transform packs it (miles: one q/k/v conv split per part; mcore:
    three convs, each column-split); a homeless mapping (`glmconv_kept.`) is requested by no trainer."""
    from glmconv.config import parse_config
    from glmconv.fixtures import preset_config
    from glmconv.mcore_layout import SHARDING
    from glmconv.plan import build_plan
    from glmconv.rules import roles
    from glmconv.rules.table import rules_in

    assert {r.role for r in rules_in(layout)} <= set(SHARDING)
    plan = build_plan(parse_config(preset_config("tiny")), layout=layout)
    r = mh.Ranks(tp=2, tp_rank=1)
    for m in plan.mappings:
        assert (mh.sharding(m) is None) == m.homeless, m.key
        assert all(bool(mh.shard_pieces(t, m, r)) != m.homeless for t in m.mcore), m.key
    assert bool(plan.homeless()) == (layout == "mcore")
    conv = [mh.sharding(m).label for m in plan.mappings if m.rule.role == roles.KDA_CONV  # type: ignore[union-attr]
            for _ in m.mcore]
    assert conv == (["column/3"] * 3 if layout == "miles" else ["column"] * 9)
