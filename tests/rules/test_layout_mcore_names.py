"""The mcore layout's keys and shapes are Megatron-Bridge's, restated here independently of the rules table.

BRIDGE below is NVIDIA Megatron-Bridge's `Glm5NextBridge.mapping_registry` (src/megatron/bridge/models/glm/
glm5_next_bridge.py, commit 3b6bc98023f9), written out by hand: Megatron parameter pattern -> HF pattern, `*` a
layer. Its mappings copy the HF tensor unchanged (AutoMapping, ColumnParallel, RowParallel, Replicated), except
the gated MLPs (gate rows then up rows, megatron-core's `GatedMLPMapping`) and the hc scale, split into three
scalar alphas. The routed experts are per-expert parameters in the module (`linear_fc1.weight{e}` /
`local_experts.{e}`), which megatron-core's `TEGroupedMLP` / `SequentialMLP.sharded_state_dict` save under one
stacked key `mlp.experts.experts.linear_fc{1,2}.weight` [E, ...] (megatron/core/transformer/moe/experts.py).
The Bridge maps no MTP layer (`mtp_num_layers = None`), no vision tower and no kpool compression parameter.
"""

from __future__ import annotations

import json

import pytest
from helpers.repo_files import REAL_CONFIG

from glmconv.config import GlmConfig, parse_config
from glmconv.fixtures import preset_config
from glmconv.plan import Plan, build_plan

HF_L = "model.language_model.layers.*."
MC_L = "decoder.layers.*."
A, ATT = HF_L + "self_attn.", MC_L + "self_attention."

# Megatron name -> (HF name, the layers whose spec builds that module: glm5_next_layer_specs.py builds KDA or DSA
# attention per layer, and a MoE MLP with its own pre-MLP norm or a dense MLP with the norm fused into linear_fc1)
MODEL, EVERY, KDA, DSA, MOE, DENSE = "model", "every", "kda", "dsa", "moe", "dense"
BRIDGE: dict[str, tuple[str, str]] = {
    "embedding.word_embeddings.weight": ("model.language_model.embed_tokens.weight", MODEL),
    "output_layer.weight": ("lm_head.weight", MODEL),
    "decoder.final_layernorm.weight": ("model.language_model.norm.weight", MODEL),
    MC_L + "input_layernorm.weight": (HF_L + "input_layernorm.weight", EVERY),
    MC_L + "pre_mlp_layernorm.weight": (HF_L + "post_attention_layernorm.weight", MOE),
    MC_L + "mlp.linear_fc1.layer_norm_weight": (HF_L + "post_attention_layernorm.weight", DENSE),
    ATT + "linear_q_down_proj.weight": (A + "q_a_proj.weight", DSA),
    ATT + "linear_q_up_proj.weight": (A + "q_b_proj.weight", DSA),
    ATT + "q_layernorm.weight": (A + "q_a_layernorm.weight", DSA),
    ATT + "linear_kv_down_proj.weight": (A + "kv_a_proj_with_mqa.weight", DSA),
    ATT + "linear_kv_up_proj.weight": (A + "kv_b_proj.weight", DSA),
    ATT + "kv_layernorm.weight": (A + "kv_a_layernorm.weight", DSA),
    ATT + "linear_proj.weight": (A + "o_proj.weight", DSA),
    ATT + "core_attention.indexer.linear_wq_b.weight": (A + "indexer.wq_b.weight", DSA),
    ATT + "core_attention.indexer.linear_wk.weight": (A + "indexer.wk.weight", DSA),
    ATT + "core_attention.indexer.k_norm.weight": (A + "indexer.k_norm.weight", DSA),
    ATT + "core_attention.indexer.k_norm.bias": (A + "indexer.k_norm.bias", DSA),
    ATT + "core_attention.indexer.linear_weights_proj.weight": (A + "indexer.weights_proj.weight", DSA),
    MC_L + "mlp.router.weight": (HF_L + "mlp.gate.weight", MOE),
    MC_L + "mlp.router.expert_bias": (HF_L + "mlp.gate.e_score_correction_bias", MOE),
    MC_L + "mlp.linear_fc2.weight": (HF_L + "mlp.down_proj.weight", DENSE),
    MC_L + "mlp.shared_experts.linear_fc2.weight": (HF_L + "mlp.shared_experts.down_proj.weight", MOE),
    **{ATT + n: (A + n, KDA) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight",
                                       "k_conv1d.weight", "v_conv1d.weight", "f_b_proj.weight", "g_b_proj.weight",
                                       "b_proj.weight", "A_log", "dt_bias", "f_a_proj.weight", "g_a_proj.weight",
                                       "o_norm.weight", "o_proj.weight")},
    **{MC_L + f"{site}.{p}": (HF_L + f"{hf_site}_{q}", EVERY)
       for site, hf_site in (("self_attention_hyper_connection", "hc_attn"), ("mlp_hyper_connection", "hc_ffn"))
       for p, q in (("mapping_proj.weight", "fn"), ("bias", "base"))},
}
GATED = {  # Megatron fc1 -> (gate, up) HF names, the layers
    MC_L + "mlp.linear_fc1.weight": (HF_L + "mlp.gate_proj.weight", HF_L + "mlp.up_proj.weight", DENSE),
    MC_L + "mlp.shared_experts.linear_fc1.weight": (HF_L + "mlp.shared_experts.gate_proj.weight",
                                                    HF_L + "mlp.shared_experts.up_proj.weight", MOE),
}
EXPERTS = {  # the stacked sharded key -> HF per-expert patterns (`#` the expert), in fc1's gate-then-up order
    MC_L + "mlp.experts.experts.linear_fc1.weight": (HF_L + "mlp.experts.#.gate_proj.weight",
                                                     HF_L + "mlp.experts.#.up_proj.weight"),
    MC_L + "mlp.experts.experts.linear_fc2.weight": (HF_L + "mlp.experts.#.down_proj.weight",),
}
ALPHAS = [MC_L + f"{site}.alpha_{a}" for site in ("self_attention_hyper_connection", "mlp_hyper_connection")
          for a in ("pre", "post", "res")]
KEPT = "glmconv_kept."


def _configs() -> dict[str, GlmConfig]:
    return {"tiny": parse_config(preset_config("tiny")), "cut8": parse_config(preset_config("cut8")),
            "release": parse_config(json.loads(REAL_CONFIG.read_text()))}


@pytest.fixture(scope="module", params=["tiny", "cut8", "release"])
def plans(request: pytest.FixtureRequest) -> tuple[Plan, Plan]:
    cfg = _configs()[request.param]
    return build_plan(cfg, layout="mcore"), build_plan(cfg, layout="miles")


def _kinds(plan: Plan, layer: int | None) -> set[str]:
    """The module kinds the Bridge's layer spec builds for `layer` (None: the model's own modules)."""
    if layer is None:
        return {MODEL}
    cfg = plan.config
    return {EVERY, cfg.attn_types[layer], cfg.mlp_types[layer]}


def _expected(plan: Plan) -> dict[str, tuple[int, ...]]:
    """The Bridge's Megatron keys and shapes, from the HF side of the plan, the restatement and the spec alone."""
    hf = {t.name: t.shape for t in plan.hf_tensors()}
    out: dict[str, tuple[int, ...]] = {}
    for layer in (*range(plan.config.num_layers), None):
        kinds = _kinds(plan, layer)

        def at(pattern: str, layer: int | None = layer) -> str:
            return pattern if layer is None else pattern.replace("*", str(layer), 1)

        for mc, (h, where) in BRIDGE.items():
            if where in kinds and at(h) in hf:
                out[at(mc)] = hf[at(h)]
        for mc, (gate, up, where) in GATED.items():
            if where in kinds:
                g, u = hf[at(gate)], hf[at(up)]
                out[at(mc)] = (g[0] + u[0], *g[1:])
        if MOE in kinds:
            for mc, parts in EXPERTS.items():
                n = plan.config.text["n_routed_experts"]
                assert all(at(p).replace("#", str(e)) in hf for p in parts for e in range(n))
                rows = sum(hf[at(p).replace("#", "0")][0] for p in parts)
                out[at(mc)] = (n, rows, hf[at(parts[0]).replace("#", "0")][1])
        if EVERY in kinds:
            out.update({at(mc): (1,) for mc in ALPHAS})
    return out


def test_every_tensor_the_bridge_loads_is_where_and_shaped_as_the_bridge_says(plans: tuple[Plan, Plan]) -> None:
    mcore, _ = plans
    planned = {t.name: t.shape for t in mcore.mcore_tensors() if not t.name.startswith(KEPT)}
    assert planned == _expected(mcore)


def test_what_the_bridge_has_no_parameter_for_is_kept_and_nothing_else(plans: tuple[Plan, Plan]) -> None:
    mcore, miles = plans
    kept = {t.name[len(KEPT):] for t in mcore.mcore_tensors() if t.name.startswith(KEPT)}
    kpool = {n for n in kept if n.startswith("decoder.")}
    assert kpool == {f"decoder.layers.{i}.self_attention.core_attention.indexer.index_kpool_compress_{w}"
                     for i, full in enumerate(mcore.config.indexer_full) if full and mcore.config.attn_types[i] == "dsa"
                     for w in ("gate", "ape")}
    rest = kept - kpool
    assert rest and all(n.startswith(("mtp.layers.", "vision_model.")) for n in rest)
    assert {n for n in rest if n.startswith("vision_model.")} == {n for n in miles.mcore_index
                                                                   if n.startswith("vision_model.")}


def test_homeless_mappings_ask_for_no_extra_state(plans: tuple[Plan, Plan]) -> None:
    mcore, _ = plans
    assert not [k for k in mcore.mcore_objects() if KEPT in k or ".mtp." in k or k.startswith("mtp.")]


def test_both_layouts_map_the_same_hf_tensors_one_for_one(plans: tuple[Plan, Plan]) -> None:
    mcore, miles = plans
    assert mcore.hf_index.keys() == miles.hf_index.keys()
    assert [m.key for m in mcore.mappings] == [m.key for m in miles.mappings]
