"""The real-cut fixture presets: the release's config cut to N layers at the real dims, generated from the plan.

A real cut is 11-19 GB, so nothing here writes one: configs, plans and byte totals are checked as numbers, and
generation runs on a shrunk variant (`dims`, not on the CLI) through the very same code path.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_helpers as hf
import pytest
import torch
from click.testing import CliRunner
from repo_files import REAL_CONFIG

from glmconv import api
from glmconv.config import DSA, KDA, parse_config
from glmconv.fixtures import FixtureError, make_fixture, preset_config, real
from glmconv.fixtures.generate import upstream_shapes
from glmconv.fixtures.tensors import fixture_tensors
from glmconv.numerics.fp8 import dequantize_fp8_blocks
from glmconv.plan import FP8
from glmconv.rules import names
from glmconv_cli.main import cli

# Real structure, toy widths: 4 layers (KDA x3 dense, DSA + MoE), 8 experts, vocab 1024.
SHRUNK = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 128,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 4,
          "index_head_dim": 32, "linear_num_heads": 4, "linear_head_dim": 32}
RELEASE = json.loads(REAL_CONFIG.read_text())


def _shrunk(path: Path, **kw) -> real.RealCutInfo:
    return real.write_real_cut(path, dims=SHRUNK, **{"threads": 2, "shard_bytes": 4 * 10**6, **kw})


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# --- the config -----------------------------------------------------------------------------------------------

def test_real_cut4_has_the_release_dims():
    text = preset_config("real-cut4")["text_config"]
    got = {k: text[k] for k in ("hidden_size", "linear_num_heads", "linear_head_dim", "q_lora_rank", "kv_lora_rank",
                                "n_routed_experts", "moe_intermediate_size", "intermediate_size", "vocab_size",
                                "index_kpool", "index_topk", "num_attention_heads")}
    assert got == {"hidden_size": 4096, "linear_num_heads": 64, "linear_head_dim": 128, "q_lora_rank": 1536,
                   "kv_lora_rank": 512, "n_routed_experts": 288, "moe_intermediate_size": 2048,
                   "intermediate_size": 12288, "vocab_size": 154880, "index_kpool": 4, "index_topk": 2048,
                   "num_attention_heads": 64}
    assert {k: v for k, v in text.items() if k not in _CUT_KEYS} == \
        {k: v for k, v in RELEASE["text_config"].items() if k not in _CUT_KEYS}


_CUT_KEYS = {"num_hidden_layers", "layer_types", "mlp_layer_types", "indexer_types", "linear_attn_config",
             "num_nextn_predict_layers"}


def test_real_cut4_is_layers_0_to_3_of_the_release_schedule_without_mtp_or_vision():
    cfg = preset_config("real-cut4")
    text, lac = cfg["text_config"], cfg["text_config"]["linear_attn_config"]
    assert text["num_hidden_layers"] == 4 and text["num_nextn_predict_layers"] == 0
    assert text["layer_types"] == RELEASE["text_config"]["layer_types"][:4]
    assert text["mlp_layer_types"] == ["dense", "dense", "dense", "sparse"]
    assert (lac["kda_layers"], lac["full_attn_layers"]) == ([0, 1, 2], [3])
    g = parse_config(cfg)
    assert g.attn_types == (KDA, KDA, KDA, DSA) and g.mlp_types == ("dense", "dense", "dense", "moe")
    assert cfg["vision_config"] is None and g.vision is None and g.num_mtp_layers == 0
    assert "quantization_config" not in cfg and cfg["image_token_id"] == RELEASE["image_token_id"] == 154854


def test_layers_8_cuts_deeper_with_the_release_schedule():
    text = preset_config("real-cut4", layers=8)["text_config"]
    assert text["linear_attn_config"]["full_attn_layers"] == [3, 7]
    assert text["linear_attn_config"]["kda_layers"] == [0, 1, 2, 4, 5, 6]
    assert text["mlp_layer_types"].count("dense") == 3 and len(text["indexer_types"]) == 8


def test_fp8_carries_the_release_quantization_config():
    q = preset_config("real-cut4", fp8=True)["quantization_config"]
    assert {k: v for k, v in q.items() if k != "modules_to_not_convert"} == \
        {k: v for k, v in RELEASE["quantization_config"].items() if k != "modules_to_not_convert"}
    assert {"lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj"} <= set(q["modules_to_not_convert"])
    assert "model.layers.3.self_attn.q_a_proj" not in q["modules_to_not_convert"]


@pytest.mark.parametrize("fp8,tensors,nbytes", [(False, 972, 19_080_660_960), (True, 1852, 11_256_000_480)])
def test_real_cut4_size_from_the_plan(fp8, tensors, nbytes):
    plan = real.cut_plan(preset_config("real-cut4", fp8=fp8), fp8=fp8)
    assert (len(plan.hf_index), real.cut_bytes(fp8=fp8)) == (tensors, nbytes)
    assert sum(t.dtype == FP8 for t in plan.hf_index.values()) == (880 if fp8 else 0)


@pytest.mark.parametrize("layers", [4, 8])
def test_real_cut_plan_equals_transformers_shapes(layers):
    """Generation skips transformers (the GPU host's lacks Glm5Next); this is where the plan meets it.

    transformers builds a default vision tower for `vision_config: null`; glmconv's cut has none.
    """
    cfg = preset_config("real-cut4", layers=layers)
    upstream = {n: s for n, s in upstream_shapes(cfg).items() if not n.startswith(names.HF_VISUAL_PREFIX)}
    assert upstream == {n: t.shape for n, t in real.cut_plan(cfg, fp8=False).hf_index.items()}


# --- --layers -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [0, -1, 46])
def test_layers_outside_the_release_is_a_one_line_error(layers):
    with pytest.raises(FixtureError, match=rf"^--layers {layers}: must be between 1 and 45 \(the release's"):
        preset_config("real-cut4", layers=layers)


def test_layers_is_for_real_cut_presets_only():
    with pytest.raises(FixtureError, match=r"^--layers is for the real-cut presets \(real-cut4\), not 'tiny'$"):
        preset_config("tiny", layers=2)


def test_make_fixture_takes_layers_for_real_cuts_only(tmp_path):
    with pytest.raises(FixtureError, match=r"^--layers 46: must be between 1 and 45"):
        make_fixture(tmp_path / "a", "real-cut4", layers=46)
    with pytest.raises(FixtureError, match=r"^--layers is for the real-cut presets \(real-cut4\), not 'cut8'$"):
        make_fixture(tmp_path / "b", "cut8", layers=2)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (["--preset", "tiny", "--layers", "2"], "error: Invalid value for --layers: only the real-cut presets "
                                            "(real-cut4) take a layer count"),
    (["--preset", "real-cut4", "--layers", "0"], "error: --layers 0: must be between 1 and 45 (the release's "
                                                 "decoder layers)"),
])


def test_cli_refuses_bad_layers_before_writing(tmp_path, args, message):
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["fixture", "make", str(out), *args])
    assert (r.exit_code, r.stderr.strip()) == (2, message) and not out.exists()


def test_cli_refuses_a_real_cut_that_does_not_fit_unless_told(tmp_path, monkeypatch):
    from glmconv import space

    monkeypatch.setattr(space, "free_bytes", lambda path: 10**9)
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["fixture", "make", str(out), "--preset", "real-cut4", "--fp8"])
    assert r.exit_code == 2 and not out.exists()
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "needs 11.370 GB" in r.stderr and "1.000 GB free" in r.stderr and "--no-space-check" in r.stderr


# --- generation (shrunk: the same code path at toy widths) -----------------------------------------------------

@pytest.fixture(scope="module")
def shrunk(tmp_path_factory: pytest.TempPathFactory) -> real.RealCutInfo:
    return _shrunk(tmp_path_factory.mktemp("real") / "hf", seed=3)


def test_shrunk_cut_is_the_plan_and_records_preset_layers_seed(shrunk):
    cfg = json.loads((shrunk.path / "config.json").read_text())
    plan = real.cut_plan(cfg, fp8=False)
    assert hf.headers(shrunk.path) == {n: (t.shape, t.dtype) for n, t in plan.hf_index.items()}
    assert hf.index(shrunk.path)["metadata"]["total_size"] == shrunk.bytes == 6_599_728
    assert (shrunk.tensors, shrunk.shards, cfg["text_config"]["n_routed_experts"]) == (132, 2, 8)
    manifest = json.loads((shrunk.path / "glmconv.json").read_text())
    assert {k: manifest[k] for k in ("fixture", "layers", "seed", "fp8")} == \
        {"fixture": "real-cut4", "layers": 4, "seed": 3, "fp8": False}
    gen = json.loads((shrunk.path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["text_config"]["eos_token_id"] == [964, 971, 973]


def test_every_value_is_the_one_per_tensor_draw(shrunk):
    """Thread-pool drawing gives exactly what the serial fixture generator gives for the same plan."""
    plan = real.cut_plan(json.loads((shrunk.path / "config.json").read_text()), fp8=False)
    on_disk = _tensors(shrunk.path)
    serial = dict(fixture_tensors(plan, 3))
    assert serial.keys() == on_disk.keys()
    assert [n for n in serial if not torch.equal(_bits(serial[n]), _bits(on_disk[n]))] == []


def test_generation_is_byte_deterministic_whatever_the_thread_count(shrunk, tmp_path):
    again = _shrunk(tmp_path / "one-thread", seed=3, threads=1)
    assert hf.index(again.path) == hf.index(shrunk.path)
    for shard in sorted(shrunk.path.glob("*.safetensors")):
        assert (again.path / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_drawing_ahead_is_bounded_yet_in_plan_order(shrunk):
    plan = real.cut_plan(json.loads((shrunk.path / "config.json").read_text()), fp8=False)
    got = [n for n, _ in real.drawn_tensors(plan, 3, threads=4, ahead_values=1)]
    assert got == [t.name for t in plan.hf_tensors()]


def test_shrunk_bf16_cut_round_trips_through_convert_and_export_bit_exact(shrunk, tmp_path):
    summary = api.convert(shrunk.path, tmp_path / "mc")
    assert (summary["hf_tensors"], summary["mcore_tensors"]) == (132, 116)
    api.export(tmp_path / "mc", tmp_path / "hf", like=shrunk.path)
    src, got = _tensors(shrunk.path), _tensors(tmp_path / "hf")
    assert got.keys() == src.keys()
    assert [n for n in src if got[n].dtype != src[n].dtype or not torch.equal(_bits(got[n]), _bits(src[n]))] == []
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == \
        json.loads((shrunk.path / "config.json").read_text())


def test_shrunk_fp8_cut_converts_and_exports_its_codes_and_dequantised_values(tmp_path):
    src_info = _shrunk(tmp_path / "fp8", fp8=True)
    assert api.audit(src_info.path)["ok"]
    api.convert(src_info.path, tmp_path / "mc")
    api.export(tmp_path / "mc", tmp_path / "hf", like=src_info.path, fp8=True)
    src, got = _tensors(src_info.path), _tensors(tmp_path / "hf")
    fp8 = [n for n, t in src.items() if t.dtype == torch.float8_e4m3fn]
    assert got.keys() == src.keys() and len(fp8) == 40
    assert [n for n in fp8 if not torch.equal(_bits(got[n]), _bits(src[n]))] == []
    deq = [n for n in fp8 if not torch.equal(dequantize_fp8_blocks(got[n], got[names.scale_name(n)]),
                                             dequantize_fp8_blocks(src[n], src[names.scale_name(n)]))]
    assert deq == []


def test_progress_announces_the_job_on_stderr_at_once(tmp_path, capfd):
    _shrunk(tmp_path / "p", progress=True)
    err = capfd.readouterr().err.splitlines()
    assert err[0] == f"fixture real-cut4: writing 0.01 GB in 132 tensors to {tmp_path / 'p'}"


def test_cli_json_is_one_document_and_no_progress(tmp_path, monkeypatch):
    shrink = real.real_cut_config
    monkeypatch.setattr(real, "real_cut_config", lambda *a, **kw: shrink(*a, **{**kw, "dims": SHRUNK}))
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["fixture", "make", str(out), "--preset", "real-cut4", "--layers", "2", "--json"])
    assert (r.exit_code, r.stderr) == (0, "")
    got = json.loads(r.stdout)
    assert {k: got[k] for k in ("preset", "layers", "fp8", "seed", "path")} == \
        {"preset": "real-cut4", "layers": 2, "fp8": False, "seed": 0, "path": str(out)}
    assert json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
