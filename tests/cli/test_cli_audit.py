"""`glmconv audit-names`: emitted lists, planted defects (exit 1), unreadable input (exit 2), --against, fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.checkpoints import mcore_tensors, plan_tensors, tiny_config, write_hf, write_torch_dist
from helpers.repo_files import REAL_CONFIG as REAL

from glmconv.fixtures.golden import render
from glmconv.io.file_names import INDEX_NAME
from glmconv.rules.names import HF_FLAT_PREFIX
from glmconv_cli.main import cli

L1 = "model.language_model.layers.1."
FP8_W = L1 + "mlp.experts.2.down_proj.weight"


def run(*args: object) -> tuple[int, str]:
    result = CliRunner(env={"COLUMNS": "250"}).invoke(cli, ["audit-names", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


def run_json(*args: object) -> tuple[int, dict]:
    code, out = run(*args, "--json")
    return code, json.loads(out)


# ---- --emit on the real config ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def transformers_keys() -> dict[str, tuple[int, ...]]:
    """What transformers' save_pretrained writes for the real config: names and shapes (meta device)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    from transformers.models.glm5_next import Glm5NextConfig, Glm5NextForConditionalGeneration

    raw = json.loads(REAL.read_text())
    raw.pop("quantization_config", None)
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration._from_config(Glm5NextConfig(**raw), dtype=torch.bfloat16)
    sd = revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))
    return {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.slow
def test_emit_hf_text_only_is_exactly_what_transformers_saves(transformers_keys):
    code, specs = run_json(REAL, "--emit", "hf", "--no-mtp", "--no-vision")
    assert code == 0 and len(specs) == 37_534
    text = {k: v for k, v in transformers_keys.items() if not k.startswith("model.visual.")}
    assert {s["name"]: tuple(s["shape"]) for s in specs} == text


@pytest.mark.slow
def test_emit_hf_with_vision_matches_transformers_vision_tower_too(transformers_keys):
    code, specs = run_json(REAL, "--emit", "hf", "--no-mtp")
    assert code == 0 and len(specs) == 37_534 + 347
    assert {s["name"]: tuple(s["shape"]) for s in specs} == transformers_keys


def test_emit_hf_fp8_release_lists_76108_keys():
    code, specs = run_json(REAL, "--emit", "hf", "--fp8")
    assert code == 0 and len(specs) == 76_108
    by = {s["name"]: s for s in specs}
    w = "model.language_model.layers.45.mlp.experts.287.down_proj.weight"
    assert by[w] == {"name": w, "shape": [4096, 2048], "dtype": "F8_E4M3"}
    assert by[w + "_scale_inv"] == {"name": w + "_scale_inv", "shape": [32, 16], "dtype": "F32"}


def test_emit_mcore_spot_checks():
    code, specs = run_json(REAL, "--emit", "mcore")
    by = {s["name"]: (tuple(s["shape"]), s["dtype"]) for s in specs}
    assert code == 0
    assert by["embedding.word_embeddings.weight"] == ((154880, 4096), "BF16")
    assert by["decoder.layers.0.self_attention.kda.conv1d.weight"] == ((24576, 1, 4), "BF16")
    assert by["decoder.layers.0.self_attention_hyper_connection.alpha_res"] == ((1,), "F32")
    assert by["decoder.layers.0.mlp.linear_fc1.weight"] == ((24576, 4096), "BF16")
    assert by["decoder.layers.3.self_attention.linear_q_up_proj.weight"] == ((16384, 1536), "BF16")
    assert by["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"] == ((288, 4096, 4096), "BF16")
    assert by["decoder.layers.44.mlp.experts.experts.linear_fc2.weight"] == ((288, 4096, 2048), "BF16")
    assert by["mtp.layers.0.eh_proj.weight"] == ((4096, 8192), "BF16")
    assert by["mtp.layers.0.transformer_layer.mlp.router.expert_bias"] == ((288,), "F32")
    assert not any(n.startswith("decoder.layers.45.") for n in by)


def test_emit_plain_text_is_one_name_shape_dtype_line_per_tensor():
    code, out = run(REAL, "--emit", "hf", "--no-mtp", "--no-vision")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 37_534
    assert "model.language_model.layers.0.hc_attn_fn [24,16384] F32" in lines
    assert all(len(line.split(" ")) == 3 for line in lines)


def test_real_config_audits_clean():
    code, out = run(REAL, "--fp8")
    assert code == 0 and out.strip() == "OK: 76,108 tensors match the plan"


# ---- planted defects on an HF checkpoint: exit 1, naming the tensor ---------------------------------

def _defect(tmp_path: Path, tensors: dict[str, torch.Tensor], fp8: bool = False) -> tuple[int, dict]:
    return run_json(write_hf(tmp_path / "ck", tiny_config(fp8), tensors))


def _only(report: dict) -> tuple[str, str]:
    assert len(report["findings"]) == 1, report["findings"]
    return report["findings"][0]["kind"], report["findings"][0]["tensor"]


def test_clean_checkpoint_exits_0(tmp_path):
    code, out = run(write_hf(tmp_path / "ck"))
    assert code == 0 and out.strip() == f"OK: {len(plan_tensors(tiny_config()))} tensors match the plan"


def test_dropped_tensor(tmp_path):
    t = plan_tensors(tiny_config())
    del t[L1 + "self_attn.indexer.k_norm.bias"]
    code, report = _defect(tmp_path, t)
    assert code == 1 and _only(report) == ("missing", L1 + "self_attn.indexer.k_norm.bias")


def test_renamed_tensor(tmp_path):
    t = plan_tensors(tiny_config())
    t[L1 + "self_attn.indexer.k_norm.b"] = t.pop(L1 + "self_attn.indexer.k_norm.bias")
    code, report = _defect(tmp_path, t)
    assert code == 1 and sorted((f["kind"], f["tensor"]) for f in report["findings"]) == [
        ("missing", L1 + "self_attn.indexer.k_norm.bias"), ("unexpected", L1 + "self_attn.indexer.k_norm.b")]


def test_wrong_shape(tmp_path):
    t = plan_tensors(tiny_config())
    t["lm_head.weight"] = torch.zeros(63, 32, dtype=torch.bfloat16)
    code, report = _defect(tmp_path, t)
    f = report["findings"][0]
    assert code == 1 and _only(report) == ("shape", "lm_head.weight") and (f["expected"], f["found"]) == (
        "[64, 32]", "[63, 32]")


def test_wrong_dtype(tmp_path):
    t = plan_tensors(tiny_config())
    t[L1 + "mlp.gate.e_score_correction_bias"] = t[L1 + "mlp.gate.e_score_correction_bias"].half()
    code, report = _defect(tmp_path, t)
    f = report["findings"][0]
    assert code == 1 and _only(report) == ("dtype", L1 + "mlp.gate.e_score_correction_bias")
    assert (f["expected"], f["found"]) == ("F32 or BF16", "F16")


def test_fp8_weight_without_its_scale(tmp_path):
    t = plan_tensors(tiny_config(), fp8=True)
    del t[FP8_W + "_scale_inv"]
    code, report = _defect(tmp_path, t, fp8=True)
    assert code == 1 and _only(report) == ("fp8-scale-missing", FP8_W)


def test_scale_with_wrong_shape(tmp_path):
    t = plan_tensors(tiny_config(), fp8=True)
    t[FP8_W + "_scale_inv"] = torch.ones(1, 2)
    code, report = _defect(tmp_path, t, fp8=True)
    assert code == 1 and _only(report) == ("scale-shape", FP8_W + "_scale_inv")


def test_tensor_duplicated_across_shards(tmp_path):
    t = plan_tensors(tiny_config())
    names = sorted(t)
    dup = L1 + "self_attn.kv_b_proj.weight"
    shards = [{n: t[n] for n in names[::2]} | {dup: t[dup]}, {n: t[n] for n in names[1::2]} | {dup: t[dup]}]
    code, report = run_json(write_hf(tmp_path / "ck", shards=shards))
    assert code == 1 and _only(report) == ("duplicate", dup)


def test_whole_checkpoint_under_flat_prefix(tmp_path):
    code, report = _defect(tmp_path, plan_tensors(tiny_config(), prefix=HF_FLAT_PREFIX))
    assert code == 1 and _only(report) == ("prefix", "model.*")
    code, _ = run(tmp_path / "ck", "--accept-flat-prefix")
    assert code == 0


def test_one_tensor_under_flat_prefix(tmp_path):
    t = plan_tensors(tiny_config())
    t["model.layers.1.self_attn.wrong"] = t.pop(L1 + "self_attn.kv_a_layernorm.weight")
    t["model.layers.1.self_attn.kv_a_layernorm.weight"] = t.pop("model.layers.1.self_attn.wrong")
    code, report = _defect(tmp_path, t)
    assert code == 1 and _only(report) == ("prefix", "model.layers.1.self_attn.kv_a_layernorm.weight")
    assert report["findings"][0]["expected"] == L1 + "self_attn.kv_a_layernorm.weight"


def test_truncated_index_json_exits_2_naming_the_index(tmp_path):
    ck = write_hf(tmp_path / "ck")
    (ck / INDEX_NAME).write_text((ck / INDEX_NAME).read_text()[:-40])
    code, out = run(ck)
    assert code == 2 and out.startswith("error: model.safetensors.index.json: not valid JSON")


def test_truncated_shard_exits_2(tmp_path):
    ck = write_hf(tmp_path / "ck")
    shard = ck / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    code, out = run(ck)
    assert code == 2 and out.startswith("error: model-00002-of-00003.safetensors: truncated: header says")


def test_index_pointing_outside_the_directory_exits_2(tmp_path):
    ck = write_hf(tmp_path / "ck")
    index = json.loads((ck / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = "../../secrets.safetensors"
    (ck / INDEX_NAME).write_text(json.dumps(index))
    code, out = run(ck)
    assert code == 2 and "shard '../../secrets.safetensors' is outside the checkpoint directory" in out


# ---- output -----------------------------------------------------------------------------------------

def test_table_shows_20_rows_per_kind_and_the_count(tmp_path):
    t = {n: v for n, v in plan_tensors(tiny_config()).items() if ".experts." not in n}
    code, out = run(write_hf(tmp_path / "ck", tensors=t))
    assert code == 1
    assert out.count("│ missing") == 21 and "... and 4 more (24 missing in all; --json lists every one)" in out
    assert out.strip().splitlines()[-1] == "FAIL: 24 findings (24 missing)"


def test_json_report_fields(tmp_path):
    code, report = run_json(write_hf(tmp_path / "ck"))
    assert code == 0 and report["ok"] is True and report["findings"] == [] and report["against"] is None
    assert report["tensors"] == len(plan_tensors(tiny_config())) and report["src"] == str(tmp_path / "ck")


def test_unknown_path_exits_2(tmp_path):
    code, out = run(tmp_path / "missing")
    assert code == 2 and out.startswith("error: ") and "no such file or directory" in out


# ---- --against a torch_dist checkpoint --------------------------------------------------------------

def test_against_matching_torch_dist_is_clean(tmp_path):
    hf = write_hf(tmp_path / "hf", fp8=True)
    mc = write_torch_dist(tmp_path / "mc", tiny_config(True), mcore_tensors(tiny_config()))
    code, report = run_json(hf, "--against", mc)
    assert code == 0 and report["ok"] and report["against"] == str(mc)


def test_against_reports_missing_and_misshapen_megatron_tensors(tmp_path):
    tensors = mcore_tensors(tiny_config())
    del tensors["decoder.layers.0.mlp.linear_fc2.weight"]
    tensors["output_layer.weight"] = torch.zeros(32, 32, dtype=torch.bfloat16)
    mc = write_torch_dist(tmp_path / "mc", tiny_config(), tensors)
    code, report = run_json(write_hf(tmp_path / "hf"), "--against", mc)
    assert code == 1 and sorted((f["kind"], f["side"], f["tensor"]) for f in report["findings"]) == [
        ("missing", "against", "decoder.layers.0.mlp.linear_fc2.weight"),
        ("shape", "against", "output_layer.weight")]


def test_torch_dist_config_option(tmp_path):
    mc = write_torch_dist(tmp_path / "mc", None, mcore_tensors(tiny_config()), objects_of=tiny_config())
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(tiny_config()))
    code, out = run(mc)
    assert code == 2 and "pass --config CONFIG" in out
    code, out = run(mc, "--config", cfg)
    assert code == 0 and out == "src: torch_dist in the miles layout\nOK: 113 tensors match the plan\n"


# ---- the shared random fixtures (glmconv.fixtures) --------------------------------------------------

@pytest.mark.parametrize("name", ["tiny_ckpt", "tiny_fp8_ckpt", "cut8_ckpt"])
def test_fixture_checkpoints_audit_clean(request, name):
    code, report = run_json(request.getfixturevalue(name))
    assert code == 0 and report["findings"] == []
    assert report["plans"]["src"]["mtp"] and report["plans"]["src"]["vision"]
    assert report["plans"]["src"]["fp8"] is (name == "tiny_fp8_ckpt")


def test_fp8_fixture_against_bf16_fixture_is_clean(tiny_ckpt, tiny_fp8_ckpt):
    code, report = run_json(tiny_fp8_ckpt, "--against", tiny_ckpt)
    assert code == 0 and report["ok"]


def test_fixture_with_a_dropped_shard_entry_is_caught(tiny_fp8_ckpt, tmp_path):
    import shutil

    ck = Path(shutil.copytree(tiny_fp8_ckpt, tmp_path / "ck"))
    index = json.loads((ck / INDEX_NAME).read_text())
    victim = next(n for n in index["weight_map"] if n.endswith("_scale_inv"))
    del index["weight_map"][victim]
    (ck / INDEX_NAME).write_text(json.dumps(index))
    code, report = run_json(ck)
    assert code == 1 and _only(report) == ("index", victim)


# ---- goldens (fixtures/golden/): what --emit and --json print for the tiny preset -------------------------

@pytest.fixture()
def tiny_preset_config(tmp_path: Path) -> Path:
    from glmconv.fixtures.configs import preset_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(preset_config("tiny", fp8=True)))
    return path


@pytest.mark.parametrize("side,flags", [("hf", ["--fp8"]), ("mcore", [])])
def test_emit_json_of_the_tiny_preset_is_its_golden(tiny_preset_config: Path, golden, side: str,
                                                    flags: list[str]) -> None:
    code, specs = run_json(tiny_preset_config, "--emit", side, *flags)
    assert code == 0
    golden(f"audit-emit-{side}-tiny.json", render(specs))


def test_json_report_of_a_checkpoint_with_three_defects_is_its_golden(tmp_path: Path, golden) -> None:
    t = plan_tensors(tiny_config(), fp8=True)
    del t[FP8_W + "_scale_inv"]
    t[L1 + "self_attn.indexer.k_norm.b"] = t.pop(L1 + "self_attn.indexer.k_norm.bias")
    t[L1 + "mlp.gate.e_score_correction_bias"] = t[L1 + "mlp.gate.e_score_correction_bias"].half()
    code, report = run_json(write_hf(tmp_path / "ck", tiny_config(True), t))
    assert code == 1 and report["src"] == str(tmp_path / "ck")
    golden("audit-report-three-defects.json", json.dumps({**report, "src": "CHECKPOINT"}, indent=2) + "\n")
