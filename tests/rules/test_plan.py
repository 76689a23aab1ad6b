"""Rules x config: the plan is complete, bijective and shaped like the real release."""

import dataclasses
import json
from collections import Counter

import pytest
from helpers.repo_files import REAL_CONFIG as REAL

from glmconv.config import parse_config
from glmconv.plan import FP8, build_plan
from glmconv.rules import RULES
from glmconv.rules.names import HF_FLAT_PREFIX


@pytest.fixture(scope="module")
def cfg():
    return parse_config(json.loads(REAL.read_text()))


def test_bf16_text_plan_has_the_37534_tensors_save_pretrained_writes(cfg):
    assert len(build_plan(cfg, mtp=False, vision=False).hf_index) == 37_534


def test_fp8_release_plan_with_mtp_and_vision_has_76108_keys(cfg):
    assert len(build_plan(cfg, fp8=True).hf_index) == 76_108


def test_fp8_set_is_experts_shared_dense_and_four_dsa_projections(cfg):
    plan = build_plan(cfg, fp8=True, mtp=False, vision=False)
    fp8 = [n for n, t in plan.hf_index.items() if t.dtype == FP8]
    kinds = Counter(n.split(".self_attn.")[-1] if ".self_attn." in n else n.split(".mlp.")[-1].split(".", 1)[0]
                    for n in fp8)
    assert kinds["q_a_proj.weight"] == kinds["q_b_proj.weight"] == kinds["o_proj.weight"] == 11
    assert kinds["kv_a_proj_with_mqa.weight"] == 11 and "kv_b_proj.weight" not in kinds
    assert kinds["experts"] == 42 * 288 * 3 and kinds["shared_experts"] == 42 * 3
    assert sum(1 for n in fp8 if ".mlp.gate_proj" in n or ".mlp.up_proj" in n or ".mlp.down_proj" in n) == 9


def test_every_fp8_weight_has_a_block_scale_of_ceil_shape(cfg):
    plan = build_plan(cfg, fp8=True, mtp=False, vision=False)
    scale = plan.hf_index["model.language_model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert (scale.shape, scale.dtype) == ((4, 32), "F32")


def test_f32_tensors_are_hc_alog_dtbias_router_bias_and_kpool_ape(cfg):
    plan = build_plan(cfg, mtp=False, vision=False)
    f32 = {n.split(".")[-1] if "hc_" in n else n.rsplit(".", 1)[-1] for n, t in plan.hf_index.items()
           if t.dtype == "F32"}
    assert f32 == {"hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                   "A_log", "dt_bias", "e_score_correction_bias", "index_kpool_compress_ape"}


def test_every_hf_and_mcore_tensor_belongs_to_exactly_one_mapping(cfg):
    plan = build_plan(cfg, fp8=True)
    assert len(plan.mapping_of_hf) == len(plan.hf_index)
    assert len(plan.mapping_of_mcore) == len(plan.mcore_index)


def test_routed_experts_are_stacked_gate_then_up_with_expert_axis_first(cfg):
    mc = build_plan(cfg).mcore_index
    assert mc["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"].shape == (288, 4096, 4096)
    assert mc["decoder.layers.44.mlp.experts.experts.linear_fc2.weight"].shape == (288, 4096, 2048)


def test_hc_scale_splits_into_three_f32_alphas(cfg):
    m = build_plan(cfg).mapping_of_hf["model.language_model.layers.0.hc_ffn_scale"]
    assert [t.name for t in m.mcore] == [f"decoder.layers.0.mlp_hyper_connection.alpha_{a}"
                                         for a in ("pre", "post", "res")]
    assert {(t.shape, t.dtype) for t in m.mcore} == {((1,), "F32")}


def test_kda_conv1d_concatenates_q_k_v(cfg):
    m = build_plan(cfg).mapping_of_mcore["decoder.layers.0.self_attention.kda.conv1d.weight"]
    assert [t.name.rsplit(".", 2)[-2] for t in m.hf] == ["q_conv1d", "k_conv1d", "v_conv1d"]
    assert m.mcore[0].shape == (3 * 8192, 1, 4)


def test_mtp_layer_45_maps_to_megatron_mtp_layer_0_without_hc(cfg):
    plan = build_plan(cfg)
    mtp_hf = [n for n in plan.hf_index if ".layers.45." in n]
    assert len(mtp_hf) == 889 and not any("hc_" in n for n in mtp_hf)
    assert plan.mapping_of_hf["model.language_model.layers.45.shared_head.norm.weight"].mcore[0].name == \
        "mtp.layers.0.final_layernorm.weight"
    assert "mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight" in plan.mcore_index


def test_mtp_inner_layer_key_is_the_one_installed_megatron_core_saves_and_loads():
    mtp = pytest.importorskip("megatron.core.transformer.multi_token_prediction")
    import inspect

    src = inspect.getsource(mtp.MultiTokenPredictionLayer.sharded_state_dict)
    assert "{f'{prefix}mtp_model_layer.': f'{prefix}transformer_layer.'}" in src


def test_vision_tower_is_347_pass_through_tensors(cfg):
    plan = build_plan(cfg)
    vision = [m for m in plan.mappings if m.part == "vision"]
    assert sum(len(m.hf) for m in vision) == 347
    assert all(m.hf[0].name.replace("model.visual.", "vision_model.") == m.mcore[0].name for m in vision)


def test_flat_prefix_plan_names_text_tensors_under_model_dot(cfg):
    plan = build_plan(cfg, text_prefix=HF_FLAT_PREFIX, vision=False)
    assert "model.layers.0.input_layernorm.weight" in plan.hf_index
    assert "lm_head.weight" in plan.hf_index


def test_cut8_plan_has_dsa_tensors_only_at_layers_3_and_7(cfg):
    plan = build_plan(cfg.cut(8), mtp=False, vision=False)
    layers = {m.layer for m in plan.mappings if m.rule.attn == "dsa"}
    assert layers == {3, 7}


def test_rules_without_shared_experts_drop_shared_tensors(cfg):
    raw = json.loads(REAL.read_text())
    raw["text_config"]["n_shared_experts"] = 0
    plan = build_plan(parse_config(raw), vision=False)
    assert not any("shared_experts" in n for n in plan.hf_index)


def test_every_rule_is_used_by_the_real_plan(cfg):
    used = {id(m.rule) for m in build_plan(cfg, fp8=True).mappings}
    assert [r.hf for r in RULES if id(r) not in used] == []


def test_dsa_layer_with_shared_indexer_has_no_indexer_tensors():
    raw = json.loads(REAL.read_text())
    raw["text_config"]["indexer_types"][7] = "shared"
    plan = build_plan(parse_config(raw), vision=False)
    assert "model.language_model.layers.7.self_attn.indexer.wk.weight" not in plan.hf_index
    assert "model.language_model.layers.7.self_attn.kv_b_proj.weight" in plan.hf_index
    assert "model.language_model.layers.3.self_attn.indexer.wk.weight" in plan.hf_index


def test_every_bf16_or_f32_tensor_accepts_both_on_disk_but_not_f16(cfg):
    plan = build_plan(cfg, vision=False)
    fn = plan.hf_index["model.language_model.layers.0.hc_attn_fn"]
    q = plan.hf_index["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert (fn.dtype, fn.accepts("BF16"), fn.accepts("F32"), fn.accepts("F16")) == ("F32", True, True, False)
    assert (q.dtype, q.accepts("BF16"), q.accepts("F32"), q.accepts("F16")) == ("BF16", True, True, False)
    assert plan.mcore_index["decoder.layers.0.self_attention_hyper_connection.mapping_proj.weight"].dtype == "F32"


def test_fp8_weights_of_an_fp8_plan_accept_only_fp8(cfg):
    spec = build_plan(cfg, fp8=True, vision=False).hf_index["model.language_model.layers.0.mlp.down_proj.weight"]
    assert (spec.dtype, spec.accepts("BF16"), spec.accepts("F32")) == ("F8_E4M3", False, False)


CONV = ("model.language_model.layers.0.self_attn.q_conv1d.weight", "model.language_model.layers.0.self_attn.k_conv1d"
        ".weight", "model.language_model.layers.0.self_attn.v_conv1d.weight")
MC_CONV = "decoder.layers.0.self_attention.kda.conv1d.weight"
MC_Q, MC_A_LOG = "decoder.layers.0.self_attention.kda.q_proj.weight", "decoder.layers.0.self_attention.kda.A_log"


def _mcore_dtypes(cfg, dtype: str, stored: dict[str, str]) -> tuple[str, str, str]:
    plan = build_plan(cfg, vision=False, dtype=dtype, stored=stored)
    return tuple(plan.mcore_index[n].dtype for n in (MC_CONV, MC_Q, MC_A_LOG))


def test_dtype_keep_gives_megatron_what_the_source_stores(cfg):
    f32_conv = dict.fromkeys(CONV, "F32")
    assert _mcore_dtypes(cfg, "keep", f32_conv) == ("F32", "BF16", "F32")
    assert _mcore_dtypes(cfg, "keep", {}) == ("BF16", "BF16", "F32")  # unknown: the release's


def test_dtype_keep_meets_mixed_parts_of_one_tensor_in_f32(cfg):
    assert _mcore_dtypes(cfg, "keep", {CONV[0]: "F32", CONV[1]: "BF16", CONV[2]: "BF16"})[0] == "F32"


def test_dtype_keep_dequantises_fp8_to_bf16(cfg):
    assert _mcore_dtypes(cfg, "keep", {"model.language_model.layers.0.self_attn.q_proj.weight": "F8_E4M3"})[1] == "BF16"


def test_dtype_bf16_and_fp32_decide_every_weight_but_f32_state_stays_f32(cfg):
    f32_conv = dict.fromkeys(CONV, "F32")
    assert _mcore_dtypes(cfg, "bf16", f32_conv) == ("BF16", "BF16", "F32")
    assert _mcore_dtypes(cfg, "fp32", {}) == ("F32", "F32", "F32")
    assert _mcore_dtypes(cfg, "bf16", {"model.language_model.layers.0.self_attn.A_log": "BF16"})[2] == "F32"


def test_release_total_size_is_reached_with_bf16_hc_fn_and_kpool_ape(cfg):
    plan = build_plan(cfg, fp8=True)
    bf16_too = ("hc_attn_fn", "hc_ffn_fn", "index_kpool_compress_ape")
    total = sum(t.nbytes // 2 if t.name.endswith(bf16_too) else t.nbytes for t in plan.hf_tensors())
    assert total == 328_326_771_576


def test_every_transformer_engine_module_asks_for_an_extra_state_and_experts_one_each(cfg):
    keys = build_plan(cfg, vision=False).mcore_objects()
    assert "decoder.layers.3.self_attention.linear_q_down_proj._extra_state/shard_0_1" in keys
    assert "decoder.layers.0.self_attention.kda.q_proj._extra_state/shard_0_1" in keys
    assert "decoder.layers.3.mlp.experts.experts.linear_fc2._extra_state/shard_287_288" in keys
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in keys
    assert not any("router" in k or "embedding" in k or "output_layer" in k or "o_norm" in k for k in keys)


def test_every_transformer_engine_norm_asks_for_an_extra_state(cfg):
    """TENorm modules (the layer and final norms, the MoE pre-MLP norm, the indexer's k_norm) save one too; a norm
    fused into a TE linear (`linear_fc1.layer_norm_weight`, miles' q/kv norms) is the linear's."""
    norms = {k for k in build_plan(cfg, vision=False).mcore_objects() if "norm" in k}
    assert {k for k in norms if not k.startswith("mtp.")} == {
        "decoder.final_layernorm._extra_state/shard_0_1",
        *(f"decoder.layers.{i}.input_layernorm._extra_state/shard_0_1" for i in range(cfg.num_layers)),
        *(f"decoder.layers.{i}.pre_mlp_layernorm._extra_state/shard_0_1" for i in range(cfg.num_layers)
          if cfg.mlp_types[i] == "moe"),
        *(f"decoder.layers.{i}.self_attention.k_norm._extra_state/shard_0_1" for i in range(cfg.num_layers)
          if cfg.attn_types[i] == "dsa" and cfg.indexer_full[i])}


def test_the_mcore_layouts_q_and_kv_norms_are_modules_of_their_own(cfg):
    norms = {k for k in build_plan(cfg, layout="mcore").mcore_objects() if "layernorm" in k and "attention" in k}
    assert norms == {f"decoder.layers.{i}.self_attention.{n}_layernorm._extra_state/shard_0_1"
                     for i in range(cfg.num_layers) if cfg.attn_types[i] == "dsa" for n in ("q", "kv")}


def test_a_plan_built_again_is_the_callers_own(cfg):
    first = build_plan(cfg, fp8=True)
    n_mappings, name = len(first.mappings), next(iter(first.hf_index))
    first.mappings.pop()
    del first.hf_index[name]
    again = build_plan(cfg, fp8=True)
    assert len(again.mappings) == n_mappings and name in again.hf_index


def test_a_plan_built_again_carries_the_callers_config(cfg):
    raw = json.loads(REAL.read_text())
    same = dataclasses.replace(cfg, raw=raw)  # equal to cfg: `raw` is not compared
    build_plan(cfg)
    assert build_plan(same).config is same


def test_plans_of_configs_that_differ_are_not_confused(cfg):
    raw = json.loads(REAL.read_text())
    raw["text_config"]["vocab_size"] = 1024
    smaller_vocab, cut = parse_config(raw), cfg.cut(8)
    embedding = "model.language_model.embed_tokens.weight"
    full = build_plan(cfg)
    assert build_plan(smaller_vocab).hf_index[embedding].shape == (1024, full.hf_index[embedding].shape[1])
    assert len(build_plan(cut).hf_index) < len(build_plan(cfg).hf_index) == len(full.hf_index)


def test_at_most_four_plans_are_kept(cfg):
    from glmconv import plan as plan_mod

    for layers in range(1, 7):  # six configs: each plan of the release's config is ~25 MB
        build_plan(cfg.cut(layers), mtp=False, vision=False)
    assert len(plan_mod._BUILT._plans) == plan_mod._BuiltPlans.KEEP == 4
