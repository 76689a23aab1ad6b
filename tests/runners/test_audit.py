"""audit(): each side against its plan, and two sides against each other through the mapping."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoints import mcore_tensors, plan_tensors, tiny_config, write_hf, write_torch_dist

from glmconv.config import parse_config
from glmconv.errors import CheckpointError
from glmconv.plan import build_plan
from glmconv.rules.names import HF_FLAT_PREFIX, HF_TEXT_PREFIX
from glmconv.runners.audit import AuditReport, Finding, audit, expected_tensors

L1 = "model.language_model.layers.1."
MTP = "model.language_model.layers.2."  # the tiny config's MTP layer
FP8_W = L1 + "mlp.experts.0.up_proj.weight"


def _kinds(report: AuditReport) -> list[tuple[str, str]]:
    return sorted((f.kind, f.tensor) for f in report.findings)


def _config_file(tmp_path, cfg=None):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg or tiny_config()))
    return p


# ---- one side ---------------------------------------------------------------------------------------

def test_clean_bf16_checkpoint_is_ok_with_mtp_and_vision_detected(tmp_path):
    r = audit(write_hf(tmp_path / "ck"))
    assert r.ok and r.findings == [] and r.tensors == len(plan_tensors(tiny_config()))
    assert r.plans["src"] == {"kind": "hf", "fp8": False, "mtp": True, "vision": True,
                              "text_prefix": HF_TEXT_PREFIX, "layers": 2, "ignored_beyond_layers": 0,
                              "layout": "miles", "homeless": 0}


def test_clean_fp8_checkpoint_is_detected_as_fp8(tmp_path):
    r = audit(write_hf(tmp_path / "ck", fp8=True))
    assert r.ok and r.plans["src"]["fp8"] is True
    assert r.tensors == len(build_plan(parse_config(tiny_config()), fp8=True).hf_index)


def test_config_alone_audits_its_own_plan(tmp_path):
    r = audit(_config_file(tmp_path))
    assert r.ok and r.plans["src"]["kind"] == "config"
    assert r.tensors == len(build_plan(parse_config(tiny_config())).hf_index)


def test_checkpoint_without_mtp_and_vision_is_clean_without_them(tmp_path):
    r = audit(write_hf(tmp_path / "ck", tensors=plan_tensors(tiny_config(), mtp=False, vision=False)))
    assert r.ok and r.plans["src"]["mtp"] is False and r.plans["src"]["vision"] is False


def test_partial_mtp_expects_the_whole_mtp_layer(tmp_path):
    tensors = plan_tensors(tiny_config(), vision=False)
    kept = MTP + "eh_proj.weight"
    tensors = {n: t for n, t in tensors.items() if not n.startswith(MTP) or n == kept}
    r = audit(write_hf(tmp_path / "ck", tensors=tensors))
    mtp_names = [n for n in build_plan(parse_config(tiny_config())).hf_index if n.startswith(MTP) and n != kept]
    assert _kinds(r) == sorted(("missing", n) for n in mtp_names)


def test_partial_vision_expects_the_whole_tower(tmp_path):
    tensors = plan_tensors(tiny_config())
    del tensors["model.visual.blocks.0.attn.qkv.weight"]
    r = audit(write_hf(tmp_path / "ck", tensors=tensors))
    assert _kinds(r) == [("missing", "model.visual.blocks.0.attn.qkv.weight")]
    assert r.findings[0].expected == "BF16[48, 16]" and r.findings[0].found == "absent"


def test_explicit_no_mtp_makes_mtp_tensors_unexpected(tmp_path):
    r = audit(write_hf(tmp_path / "ck"), mtp=False)
    unexpected = {f.tensor for f in r.findings if f.kind == "unexpected"}
    assert unexpected and all(n.startswith(MTP) for n in unexpected) and len(unexpected) == len(r.findings)


def test_explicit_mtp_on_a_checkpoint_without_it_reports_all_missing(tmp_path):
    r = audit(write_hf(tmp_path / "ck", tensors=plan_tensors(tiny_config(), mtp=False)), mtp=True)
    assert r.findings and {f.kind for f in r.findings} == {"missing"}
    assert all(f.tensor.startswith(MTP) for f in r.findings)


def test_wrong_shape_and_dtype_name_the_tensor_and_file(tmp_path):
    tensors = plan_tensors(tiny_config())
    tensors[L1 + "self_attn.q_a_proj.weight"] = torch.zeros(16, 33, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].half()  # BF16 and F32 are accepted, F16 is not
    r = audit(write_hf(tmp_path / "ck", tensors=tensors))
    by_kind = {f.kind: f for f in r.findings}
    assert set(by_kind) == {"shape", "dtype"}
    assert (by_kind["shape"].tensor, by_kind["shape"].expected, by_kind["shape"].found) == (
        L1 + "self_attn.q_a_proj.weight", "[16, 32]", "[16, 33]")
    assert (by_kind["dtype"].tensor, by_kind["dtype"].expected, by_kind["dtype"].found) == (
        "lm_head.weight", "BF16 or F32", "F16")
    assert by_kind["dtype"].file.startswith("model-000") and by_kind["dtype"].file.endswith(".safetensors")


def test_fp8_weight_without_scale(tmp_path):
    tensors = plan_tensors(tiny_config(), fp8=True)
    del tensors[FP8_W + "_scale_inv"]
    r = audit(write_hf(tmp_path / "ck", tiny_config(True), tensors))
    assert [(f.kind, f.tensor, f.expected) for f in r.findings] == [
        ("fp8-scale-missing", FP8_W, f"{FP8_W}_scale_inv F32[1, 1]")]


def test_scale_with_wrong_shape(tmp_path):
    tensors = plan_tensors(tiny_config(), fp8=True)
    tensors[FP8_W + "_scale_inv"] = torch.ones(2, 1)
    r = audit(write_hf(tmp_path / "ck", tiny_config(True), tensors))
    assert [(f.kind, f.tensor, f.expected, f.found) for f in r.findings] == [
        ("scale-shape", FP8_W + "_scale_inv", "[1, 1]", "[2, 1]")]


def test_scale_for_a_weight_outside_the_fp8_set_is_orphan(tmp_path):
    tensors = plan_tensors(tiny_config(), fp8=True)
    tensors[L1 + "self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(1, 1)
    r = audit(write_hf(tmp_path / "ck", tiny_config(True), tensors))
    assert _kinds(r) == [("orphan-scale", L1 + "self_attn.kv_b_proj.weight_scale_inv")]


def test_fp8_tensors_without_quantization_config_is_a_config_finding(tmp_path):
    r = audit(write_hf(tmp_path / "ck", tiny_config(False), plan_tensors(tiny_config(), fp8=True)))
    assert [(f.kind, f.tensor) for f in r.findings] == [("config", "quantization_config")]


def test_quantization_config_on_bf16_checkpoint_is_a_config_finding(tmp_path):
    r = audit(write_hf(tmp_path / "ck", tiny_config(True), plan_tensors(tiny_config())))
    assert [(f.kind, f.tensor) for f in r.findings] == [("config", "quantization_config")]
    assert "no tensor is FP8" in r.findings[0].found


def test_whole_checkpoint_flat_prefix_is_one_prefix_finding(tmp_path):
    ck = write_hf(tmp_path / "ck", tensors=plan_tensors(tiny_config(), prefix=HF_FLAT_PREFIX))
    r = audit(ck)
    assert [(f.kind, f.tensor) for f in r.findings] == [("prefix", "model.*")]
    assert r.plans["src"]["text_prefix"] == HF_FLAT_PREFIX


def test_accept_flat_prefix_passes(tmp_path):
    ck = write_hf(tmp_path / "ck", tensors=plan_tensors(tiny_config(), prefix=HF_FLAT_PREFIX))
    assert audit(ck, accept_flat_prefix=True).ok


def test_mixed_prefix_reports_each_off_prefix_tensor(tmp_path):
    tensors = plan_tensors(tiny_config())
    tensors["model.norm.weight"] = tensors.pop("model.language_model.norm.weight")
    ln = "layers.0.input_layernorm.weight"
    tensors["model." + ln] = tensors.pop("model.language_model." + ln)
    r = audit(write_hf(tmp_path / "ck", tensors=tensors), accept_flat_prefix=True)
    assert [(f.kind, f.tensor, f.expected) for f in r.findings] == [
        ("prefix", "model.layers.0.input_layernorm.weight", "model.language_model.layers.0.input_layernorm.weight"),
        ("prefix", "model.norm.weight", "model.language_model.norm.weight")]


def test_renamed_tensor_is_missing_plus_unexpected(tmp_path):
    tensors = plan_tensors(tiny_config())
    tensors[L1 + "self_attn.q_a_norm.weight"] = tensors.pop(L1 + "self_attn.q_a_layernorm.weight")
    r = audit(write_hf(tmp_path / "ck", tensors=tensors))
    assert _kinds(r) == [("missing", L1 + "self_attn.q_a_layernorm.weight"),
                         ("unexpected", L1 + "self_attn.q_a_norm.weight")]


def test_index_and_duplicate_problems_become_findings(tmp_path):
    tensors = plan_tensors(tiny_config())
    names = list(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]}
    second = {n: tensors[n] for n in names[len(names) // 2:]} | {"lm_head.weight": tensors["lm_head.weight"]}
    r = audit(write_hf(tmp_path / "ck", shards=[first, second]))
    assert _kinds(r) == [("duplicate", "lm_head.weight")]


def test_layers_option_cuts_the_plan(tmp_path):
    cfg = tiny_config()
    r = audit(_config_file(tmp_path, cfg), layers=1)
    assert r.plans["src"]["layers"] == 1
    assert r.tensors == len(build_plan(parse_config(cfg).cut(1)).hf_index)


def test_many_findings_are_all_kept(tmp_path):
    tensors = {n: t for n, t in plan_tensors(tiny_config()).items() if ".experts." not in n}
    r = audit(write_hf(tmp_path / "ck", tensors=tensors))
    assert r.counts() == {"missing": 4 * 3 * 2}  # 4 experts x 3 projections x (layer 1 + MTP layer)
    assert r.summary() == "FAIL: 24 findings (24 missing)"
    assert len(r.as_json()["findings"]) == 24


def test_missing_path_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="nope: no such file or directory"):
        audit(tmp_path / "nope")


def test_empty_dir_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="empty directory"):
        audit(tmp_path)


# ---- torch_dist and --against ------------------------------------------------------------------------

def test_clean_torch_dist_checkpoint(tmp_path):
    r = audit(write_torch_dist(tmp_path / "mc", tiny_config(), mcore_tensors(tiny_config())))
    assert r.ok and r.plans["src"]["kind"] == "mcore" and r.plans["src"]["mtp"] and r.plans["src"]["vision"]
    assert r.tensors == len(build_plan(parse_config(tiny_config())).mcore_index)


def test_torch_dist_without_config_needs_config_option(tmp_path):
    root = write_torch_dist(tmp_path / "mc", None, mcore_tensors(tiny_config()), objects_of=tiny_config())
    with pytest.raises(CheckpointError, match="no config.json next to it .*, or pass --config CONFIG"):
        audit(root)
    assert audit(root, config=_config_file(tmp_path)).ok


def test_torch_dist_without_common_state_is_a_finding(tmp_path):
    r = audit(write_torch_dist(tmp_path / "mc", tiny_config(), mcore_tensors(tiny_config()), common=False))
    assert _kinds(r) == [("missing", "common_state")]


def test_hf_against_matching_torch_dist_is_clean(tmp_path):
    hf = write_hf(tmp_path / "hf", fp8=True)
    mc = write_torch_dist(tmp_path / "mc", tiny_config(True), mcore_tensors(tiny_config()))
    r = audit(hf, mc)
    assert r.ok, r.findings
    assert r.summary() == f"OK: {r.tensors + r.against_tensors:,} tensors match the plan"


def test_an_audit_builds_each_plan_once(tmp_path, monkeypatch):
    """A side's own plan, its FP8 vote's and the cross-check's full plan are often one plan: built once each (a
    plan costs per tensor; export audits every output it stages)."""
    import glmconv.runners.audit as audit_mod

    built: list[tuple] = []
    build = audit_mod.build_plan
    monkeypatch.setattr(audit_mod, "build_plan", lambda config, **kw: built.append((id(config), *sorted(kw.items())))
                        or build(config, **kw))
    hf = write_hf(tmp_path / "hf", fp8=True)
    mc = write_torch_dist(tmp_path / "mc", tiny_config(True), mcore_tensors(tiny_config()))
    assert audit(hf, mc).ok
    assert len(built) == len(set(built)) == 2  # the HF side's, the torch_dist side's


def test_against_reports_missing_and_misshapen_megatron_tensors(tmp_path):
    hf = write_hf(tmp_path / "hf")
    tensors = mcore_tensors(tiny_config())
    del tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"]
    tensors["decoder.layers.0.self_attention.kda.conv1d.weight"] = torch.zeros(16, 1, 4, dtype=torch.bfloat16)
    r = audit(hf, write_torch_dist(tmp_path / "mc", tiny_config(), tensors))
    assert [(f.kind, f.side, f.tensor, f.expected, f.found) for f in r.findings] == [
        ("shape", "against", "decoder.layers.0.self_attention.kda.conv1d.weight", "[48, 1, 4]", "[16, 1, 4]"),
        ("missing", "against", "decoder.layers.1.mlp.experts.experts.linear_fc1.weight", "BF16[4, 32, 32]",
         "absent")]


def test_against_catches_a_part_one_side_dropped_entirely(tmp_path):
    hf = write_hf(tmp_path / "hf")
    mc = write_torch_dist(tmp_path / "mc", tiny_config(), mcore_tensors(tiny_config(), mtp=False))
    r = audit(hf, mc)
    missing = {f.tensor for f in r.findings}
    assert {f.kind for f in r.findings} == {"missing"} and {f.side for f in r.findings} == {"against"}
    assert missing == {n for n in build_plan(parse_config(tiny_config())).mcore_index if n.startswith("mtp.")}
    assert all("maps from model.language_model.layers.2." in f.expected for f in r.findings)


def test_against_with_a_different_config_reports_config_and_shapes(tmp_path):
    other = tiny_config()
    other["text_config"]["moe_intermediate_size"] = 24
    hf = write_hf(tmp_path / "hf")
    mc = write_torch_dist(tmp_path / "mc", other, mcore_tensors(other))
    r = audit(hf, mc)
    config = [(f.tensor, f.expected, f.found) for f in r.findings if f.kind == "config"]
    assert ("moe_inter", "16", "24") in config and ("shared_inter", "16", "24") in config
    shapes = {f.tensor for f in r.findings if f.kind == "shape"}
    assert "decoder.layers.1.mlp.experts.experts.linear_fc2.weight" in shapes


def test_hf_against_hf_bf16_vs_fp8_is_clean(tmp_path):
    assert audit(write_hf(tmp_path / "a", fp8=True), write_hf(tmp_path / "b")).ok


def test_torch_dist_unexpected_tensor(tmp_path):
    tensors = mcore_tensors(tiny_config())
    tensors["decoder.layers.0.self_attention.kda.extra"] = torch.zeros(2)
    r = audit(write_torch_dist(tmp_path / "mc", tiny_config(), tensors))
    assert _kinds(r) == [("unexpected", "decoder.layers.0.self_attention.kda.extra")]


# ---- report and emit --------------------------------------------------------------------------------

def test_report_json_shape():
    r = AuditReport(src="a", against=None, tensors=3, against_tensors=None, plans={},
                    findings=[Finding("shape", "t", "f", "[1]", "[2]"),
                              Finding("missing", "u", "", "F32[1]", "absent")])
    j = r.as_json()
    assert j["ok"] is False and j["tensors"] == 3 and j["counts"] == {"missing": 1, "shape": 1}
    assert j["findings"][0] == {"kind": "shape", "side": "src", "tensor": "t", "file": "f", "expected": "[1]",
                                "found": "[2]"}
    assert r.summary() == "FAIL: 2 findings (1 missing, 1 shape)"


def test_expected_tensors_reads_the_config_of_a_torch_dist_dir(tmp_path):
    root = write_torch_dist(tmp_path / "mc", tiny_config(), mcore_tensors(tiny_config()))
    specs = expected_tensors(root, "mcore", mtp=False, vision=False)
    assert [s.name for s in specs] == list(build_plan(parse_config(tiny_config()), mtp=False,
                                                      vision=False).mcore_index)


def test_layers_on_a_deeper_checkpoint_audits_only_the_first_layers(tmp_path):
    r = audit(write_hf(tmp_path / "ck"), layers=1)
    full = build_plan(parse_config(tiny_config())).hf_index
    beyond = [n for n in full if n.startswith((L1, MTP))]
    assert r.ok and r.plans["src"]["ignored_beyond_layers"] == len(beyond) and not r.plans["src"]["mtp"]
    assert r.tensors == len(full) - len(beyond)


def test_layers_against_a_deeper_torch_dist(tmp_path):
    hf = write_hf(tmp_path / "hf")
    mc = write_torch_dist(tmp_path / "mc", tiny_config(), mcore_tensors(tiny_config()))
    r = audit(hf, mc, layers=1)
    assert r.ok and r.plans["against"]["mtp"] is False and r.plans["against"]["ignored_beyond_layers"] > 0


def test_missing_fp8_weight_and_its_scale_are_one_finding(tmp_path):
    tensors = plan_tensors(tiny_config(), fp8=True)
    del tensors[FP8_W], tensors[FP8_W + "_scale_inv"]
    r = audit(write_hf(tmp_path / "ck", tiny_config(True), tensors))
    assert [(f.kind, f.tensor, f.expected) for f in r.findings] == [
        ("missing", FP8_W, "F8_E4M3[16, 32] + _scale_inv F32[1, 1]")]


def test_torch_dist_without_extra_state_objects_names_each_missing_key(tmp_path):
    root = write_torch_dist(tmp_path / "mc", tiny_config(), mcore_tensors(tiny_config()), objects_of={})
    r = audit(root)
    missing = [f.tensor for f in r.findings if f.kind == "missing"]
    assert missing and all("._extra_state/shard_" in k for k in missing)


def test_trainer_optimizer_state_in_a_torch_dist_is_not_a_model_tensor(tmp_path):
    tensors = mcore_tensors(tiny_config())
    tensors["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = torch.ones(64)
    assert audit(write_torch_dist(tmp_path / "mc", tiny_config(), tensors)).ok
