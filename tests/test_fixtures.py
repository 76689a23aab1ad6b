"""`glmconv fixture make`: random checkpoints that match the plan, transformers, and themselves per seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import hf_helpers as hf
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from glmconv.config import DSA, KDA, parse_config
from glmconv.errors import GlmconvError
from glmconv.fixtures import FixtureError, generate, make_fixture, preset_config, tensors
from glmconv.io.file_names import INDEX_NAME
from glmconv.io.safetensors.writer import ShardWriter
from glmconv.numerics.fp8 import dequantize_fp8_blocks, scale_shape
from glmconv.plan import FP8, build_plan
from glmconv.rules import names
from glmconv.rules.table import MTP, VISION
from glmconv_cli.fixture_cmd import fixture


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(set(hf.index(path)["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def _plan(path: Path, fp8: bool):
    return build_plan(parse_config(_config(path)), fp8=fp8)


# --- presets ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "cut8"])
@pytest.mark.parametrize("fp8", [False, True])
def test_presets_are_valid_transformers_configs(preset, fp8):
    from transformers import Glm5NextConfig

    cfg = Glm5NextConfig(**preset_config(preset, fp8=fp8))
    text = cfg.text_config
    assert text.index_topk % text.index_kpool == 0 and text.index_kpool == 4
    assert text.num_attention_heads == text.num_key_value_heads
    assert cfg.vision_config.out_hidden_size == text.hidden_size


def test_tiny_preset_schedule_is_kda_x3_dsa_and_dense_x2_moe_x2():
    raw = preset_config("tiny")
    cfg = parse_config(raw)
    lac = raw["text_config"]["linear_attn_config"]
    assert cfg.attn_types == (KDA, KDA, KDA, DSA) and (lac["kda_layers"], lac["full_attn_layers"]) == ([0, 1, 2], [3])
    assert cfg.mlp_types == ("dense", "dense", "moe", "moe") and raw["text_config"]["first_k_dense_replace"] == 2


def test_quantization_config_only_with_fp8():
    assert "quantization_config" not in preset_config("tiny")
    q = preset_config("tiny", fp8=True)["quantization_config"]
    assert (q["quant_method"], q["fmt"], q["activation_scheme"], q["weight_block_size"]) == \
        ("fp8", "e4m3", "dynamic", [128, 128])
    assert {"lm_head", "model.embed_tokens"} <= set(q["modules_to_not_convert"])


def test_unknown_preset_is_a_one_line_error():
    with pytest.raises(FixtureError, match="unknown fixture preset 'huge'"):
        preset_config("huge")


# --- layout ----------------------------------------------------------------------------------------------

def test_tiny_names_shapes_dtypes_equal_the_plan(tiny_ckpt):
    plan = _plan(tiny_ckpt, fp8=False)
    assert hf.headers(tiny_ckpt) == {n: (t.shape, t.dtype) for n, t in plan.hf_index.items()}


def test_tiny_fp8_names_shapes_dtypes_equal_the_fp8_plan(tiny_fp8_ckpt):
    plan = _plan(tiny_fp8_ckpt, fp8=True)
    headers = hf.headers(tiny_fp8_ckpt)
    assert headers == {n: (t.shape, t.dtype) for n, t in plan.hf_index.items()}
    assert sum(1 for _, d in headers.values() if d == FP8) > 0


def test_cut8_names_shapes_dtypes_equal_the_plan(cut8_ckpt):
    assert hf.headers(cut8_ckpt) == {n: (t.shape, t.dtype) for n, t in _plan(cut8_ckpt, False).hf_index.items()}


def test_index_maps_every_tensor_to_its_shard_and_totals_its_bytes(tiny_ckpt):
    index = hf.index(tiny_ckpt)
    shards = sorted(p.name for p in tiny_ckpt.glob("*.safetensors"))
    assert 2 <= len(shards) <= 4
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for shard in shards:
        with safe_open(str(tiny_ckpt / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert all(index["weight_map"][n] == shard for n in f.keys())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in _plan(tiny_ckpt, False).hf_index.values())


def test_directory_has_config_and_generation_config_with_release_token_ids(tiny_ckpt):
    text = _config(tiny_ckpt)["text_config"]
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == text["eos_token_id"] == [452, 459, 461]
    assert gen["pad_token_id"] == text["pad_token_id"] == 452 < text["vocab_size"]
    assert "quantization_config" not in _config(tiny_ckpt)
    assert sorted(p.name for p in tiny_ckpt.iterdir() if not p.name.endswith(".safetensors")) == \
        ["config.json", "generation_config.json", "glmconv.json", INDEX_NAME]


def test_mtp_layer_tensors_sit_at_index_num_hidden_layers_without_hc(tiny_ckpt):
    plan = _plan(tiny_ckpt, False)
    n = plan.config.num_layers
    mtp = [m for m in plan.mappings if m.layer == n]
    assert {m.part for m in mtp} == {"layer", MTP} and not any(m.rule.hc for m in mtp)
    expected = {t.name for m in mtp for t in m.hf}
    in_file = {k for k in hf.headers(tiny_ckpt) if names.hf_layer_index(k, names.HF_TEXT_PREFIX) == n}
    assert in_file == expected and len(expected) > 20


def test_vision_tensors_are_present_in_bf16(tiny_ckpt):
    headers = hf.headers(tiny_ckpt)
    vision = {n for n in headers if n.startswith(names.HF_VISUAL_PREFIX)}
    plan_vision = {t.name for m in _plan(tiny_ckpt, False).mappings if m.part == VISION for t in m.hf}
    assert vision == plan_vision and len(vision) == 11 + 2 * 14
    assert {headers[n][1] for n in vision} == {"BF16"}


def test_cut8_has_dsa_at_layers_3_and_7_and_mtp(cut8_ckpt):
    plan = _plan(cut8_ckpt, False)
    assert [i for i, t in enumerate(plan.config.attn_types) if t == DSA] == [3, 7]
    dsa_layers = {m.layer for m in plan.mappings if m.rule.attn == DSA}
    assert dsa_layers == {3, 7, 8}
    headers = hf.headers(cut8_ckpt)
    assert all(t.name in headers for m in plan.mappings if m.rule.attn == DSA for t in m.hf)
    assert plan.config.mlp_types == ("dense",) * 3 + ("moe",) * 5


# --- values ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny_ckpt", "tiny_fp8_ckpt", "cut8_ckpt"])
def test_no_tensor_is_all_zero_all_one_or_non_finite(which, request):
    for name, t in _tensors(request.getfixturevalue(which)).items():
        v = t.float()
        assert v.isfinite().all(), name
        assert v.any() and not (v == 1).all(), name


def test_same_seed_gives_byte_identical_shards(tiny_ckpt, tmp_path):
    again = make_fixture(tmp_path / "again", "tiny", seed=0)
    assert _shard_bytes(again) == _shard_bytes(tiny_ckpt)
    assert (again / INDEX_NAME).read_bytes() == (tiny_ckpt / INDEX_NAME).read_bytes()


def test_different_seed_changes_every_tensor(tiny_ckpt, tmp_path):
    other = _tensors(make_fixture(tmp_path / "seed1", "tiny", seed=1))
    base = _tensors(tiny_ckpt)
    assert other.keys() == base.keys()
    assert [n for n in base if torch.equal(base[n], other[n])] == []


def _values(plan, tensors: dict[str, torch.Tensor], template_suffix: str) -> torch.Tensor:
    """All values of the tensors made by rules whose first HF template ends with `template_suffix`."""
    return torch.cat([tensors[t.name].float().flatten() for m in plan.mappings
                      if m.rule.hf[0].endswith(template_suffix) for t in m.hf])


def test_values_have_the_intended_scales(tiny_ckpt):
    plan, t = _plan(tiny_ckpt, False), _tensors(tiny_ckpt)
    a_log = _values(plan, t, ".A_log")
    assert a_log.min() >= 0 and a_log.max() <= torch.log(torch.tensor(16.0)) + 1e-6
    scale = _values(plan, t, "hc_attn_scale")
    assert scale.min() >= 0.5 and scale.max() <= 1.5
    assert abs(_values(plan, t, "e_score_correction_bias").std() - 0.01) < 0.005
    norm = _values(plan, t, "input_layernorm.weight")
    assert abs(norm.mean() - 1) < 0.05 and abs(norm.std() - 0.1) < 0.03
    q = _values(plan, t, "self_attn.q_proj.weight")  # fan-in 64: std 1/8
    assert abs(q.std() - 0.125) < 0.01


def test_fp8_weights_have_scales_and_dequantise_close_to_the_bf16_fixture(tiny_ckpt, tiny_fp8_ckpt):
    bf16, fp8 = _tensors(tiny_ckpt), _tensors(tiny_fp8_ckpt)
    quantised = [n for n, t in fp8.items() if t.dtype == torch.float8_e4m3fn]
    assert quantised and any(scale_shape(fp8[n].shape)[0] > 1 for n in quantised)
    for n in quantised:
        scale = fp8[names.scale_name(n)]
        assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(tuple(fp8[n].shape))
        deq = dequantize_fp8_blocks(fp8[n], scale, out_dtype=torch.float32)
        ref = bf16[n].float()
        assert ((deq - ref).abs() <= (2**-4 + 2**-8) * ref.abs() * 1.01 + scale.max() * 2**-10).all(), n
        assert (deq - ref).norm() / ref.norm() < 0.04, n
    kept = [n for n in bf16 if n not in quantised]
    assert all(torch.equal(bf16[n], fp8[n]) for n in kept)


# --- init: realistic (the default) and unit ---------------------------------------------------------------

def _serve_walk(path: Path, tokens: int = 128) -> tuple[list[float], list[torch.Tensor]]:
    """The serve model on `tokens` random ids (2 sequences): stream RMS after the embedding and every sub-block,
    and every SwiGLU's gate pre-activations [tokens routed, units] in call order."""
    import glmconv.ops.moe as moe
    from glmconv.models.conventions import Conventions
    from glmconv.models.model import GlmModel
    from glmconv.models.weights import HfWeights

    w = HfWeights(path)
    model, gates, swiglu = GlmModel(w.config, w, Conventions.serve()), [], moe.swiglu
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
    moe.swiglu = lambda g, u, limit: (gates.append(g.clone()), swiglu(g, u, limit))[1]
    try:
        with torch.inference_mode():
            x = model.embed(ids)
            rms = [x.square().mean().sqrt().item()]
            for layer in range(model.num_layers):
                x = model.attention(layer, x, cu)[0]
                rms.append(x.square().mean().sqrt().item())
                x = model.mlp(layer, x)[0]
                rms.append(x.square().mean().sqrt().item())
    finally:
        moe.swiglu = swiglu
    return rms, [g for g in gates if g.shape[0]]


@pytest.mark.parametrize("which", ["tiny_ckpt", "cut8_ckpt"])
def test_realistic_residual_streams_stay_at_the_real_models_scale(which, request):
    """The reference stack measured mean squares down to ~5e-6 (RMS ~2e-3) on the streams. Measured (128 tokens):
    tiny 2.0e-3 (embedding), 2.8e-3, 3.3e-3, 3.5e-3, 4.0e-3, 4.4e-3, 4.7e-3, 5.0e-3, 5.5e-3 after its 8 sub-blocks;
    cut8 the same to layer 2, then up to 7.7e-3 after its 16th; each sub-block adds 1.3e-3 to 2.5e-3 RMS."""
    rms, _ = _serve_walk(request.getfixturevalue(which))
    assert rms[0] == pytest.approx(2e-3, rel=0.03)
    assert all(2e-3 < r < 1e-2 for r in rms[1:]), rms
    assert all(a < b for a, b in zip(rms, rms[1:])), rms  # every sub-block adds to the streams


def test_realistic_gates_pass_the_clamp_in_a_few_units(tiny_ckpt):
    """Measured (128 tokens): 2 of the 160 dense units and 1 of the 32 units of each expert are above 10, for 47-51%
    of the tokens in the dense MLPs, 25-27% in the shared experts and 7-59% of a routed expert's tokens; every other
    unit's pre-activation stays within +-3.9."""
    _, gates = _serve_walk(tiny_ckpt)
    assert len(gates) == 2 + 2 * 9  # dense 0, 1; then per MoE layer the 8 routed experts (all got tokens) + shared
    for g in gates:
        share = (g > 10).float().mean(0)
        hot = share > 0
        assert int(hot.sum()) == (2 if g.shape[1] == 160 else 1)
        assert g[:, ~hot].abs().max() < 5
    every_token = [(g > 10).float().mean(0).max().item() for g in gates if g.shape[0] == 128]  # dense and shared
    assert len(every_token) == 4 and all(0.2 < s < 0.7 for s in every_token), every_token


def test_realistic_q_a_layernorm_has_a_few_channels_near_zero(tiny_ckpt):
    plan, t = _plan(tiny_ckpt, False), _tensors(tiny_ckpt)
    for m in plan.mappings:
        if m.rule.role == "dsa.q_a_norm":
            w = t[m.hf[0].name].float()
            assert int((w.abs() < 0.05).sum()) == 2 and w.numel() == 32, m.hf[0].name
            assert abs(w[w.abs() >= 0.05].mean() - 1) < 0.1


def test_realistic_changes_only_the_embedding_output_projections_gates_and_q_a_norm(tiny_ckpt, tiny_unit_ckpt):
    from glmconv.rules import roles as R

    scaled = {R.EMBED, R.DSA_Q_A_NORM, *R.SWIGLU_FC1, R.KDA_PROJ["o"], R.DSA_O_PROJ, R.DENSE_FC2, R.MOE_SHARED_FC2,
              R.MOE_EXPERTS_FC2}
    real, unit = _tensors(tiny_ckpt), _tensors(tiny_unit_ckpt)
    changed = {m.rule.role for m in _plan(tiny_ckpt, False).mappings for s in m.hf
               if not torch.equal(real[s.name], unit[s.name])}
    assert changed == scaled
    emb = names.HF_TEXT_PREFIX + "embed_tokens.weight"
    assert torch.allclose(real[emb].float(), unit[emb].float() * 2e-3, rtol=2**-7, atol=0)  # the same draw, scaled


def test_unit_init_is_the_seeded_fan_in_formula(tiny_unit_ckpt):
    """--init unit writes exactly what the generator wrote before `realistic`: N(0, 1) embeddings, N(0, 1/fan_in)
    matrices, N(1, 0.1) norms, each from a generator seeded by (seed, name)."""
    t = _tensors(tiny_unit_ckpt)
    layer = names.hf_layer(names.HF_TEXT_PREFIX, 0)

    def draw(name: str) -> torch.Tensor:
        return torch.randn(tuple(t[name].shape), generator=torch.Generator().manual_seed(tensors.tensor_seed(0, name)))

    emb, gate = names.HF_TEXT_PREFIX + "embed_tokens.weight", layer + "mlp.gate_proj.weight"
    norm = layer + "input_layernorm.weight"
    assert torch.equal(t[emb], draw(emb).to(torch.bfloat16))
    assert torch.equal(t[gate], (draw(gate) / math.sqrt(64)).to(torch.bfloat16))
    assert torch.equal(t[norm], (draw(norm) * 0.1 + 1.0).to(torch.bfloat16))


@pytest.mark.parametrize("flags,init", [([], "realistic"), (["--init", "unit"], "unit")])
def test_manifest_and_summary_record_the_init(tmp_path, flags, init):
    res = CliRunner().invoke(fixture, ["make", str(tmp_path / "f"), "--json", *flags])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["init"] == init
    manifest = json.loads((tmp_path / "f" / "glmconv.json").read_text())
    assert (manifest["seed"], manifest["init"]) == (0, init)


def test_unknown_init_is_a_one_line_error(tmp_path):
    with pytest.raises(FixtureError, match="unknown fixture init 'huge' \\(choose from realistic, unit\\)"):
        make_fixture(tmp_path / "f", init="huge")
    assert list(tmp_path.iterdir()) == []


# --- transformers ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded_tiny(tiny_ckpt):
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(tiny_ckpt, output_loading_info=True,
                                                            dtype=torch.float32)


def test_tiny_loads_in_transformers_without_missing_keys(loaded_tiny, tiny_ckpt):
    _, info = loaded_tiny
    n = parse_config(_config(tiny_ckpt)).num_layers
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # upstream ignores only `layers.45.` (the release's MTP index); the tiny MTP layer is reported instead
    assert info["unexpected_keys"] and all(names.hf_layer_index(k, names.HF_TEXT_PREFIX) == n
                                           for k in info["unexpected_keys"])


def test_transformers_keeps_the_loaded_values(loaded_tiny, tiny_ckpt):
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model, _ = loaded_tiny
    state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))
    files = _tensors(tiny_ckpt)
    assert state.keys() <= files.keys()
    assert [n for n, t in state.items() if not torch.equal(t.float(), files[n].float())] == []


def test_tiny_forward_is_finite_and_order_one(loaded_tiny):
    model, _ = loaded_tiny
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 27).unsqueeze(0)).logits
    assert logits.shape == (1, 26, 512) and logits.isfinite().all()
    assert 0.1 < logits.std().item() < 10


# --- generator checks and output handling ----------------------------------------------------------------

def test_plan_disagreeing_with_transformers_is_refused(monkeypatch):
    real = generate.upstream_shapes
    monkeypatch.setattr(generate, "upstream_shapes", lambda cfg: dict(list(real(cfg).items())[1:]))
    with pytest.raises(FixtureError, match="1 only in the plan"):
        generate.checked_plan(preset_config("tiny"), fp8=False)


def test_a_1d_tensor_without_an_init_rule_is_refused():
    with pytest.raises(FixtureError, match="no random init rule"):
        tensors.random_tensor("mystery_vector", "", (4,), seed=0)


def test_non_empty_out_is_refused_unless_forced(tmp_path):
    out = tmp_path / "out"
    make_fixture(out, "tiny")
    (out / "keep.txt").write_text("x")
    with pytest.raises(GlmconvError, match="already exists and is not empty; pass --force"):
        make_fixture(out, "tiny")
    assert (out / "keep.txt").exists()
    make_fixture(out, "tiny", force=True)
    assert not (out / "keep.txt").exists() and (out / INDEX_NAME).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_force_never_replaces_a_directory_glmconv_did_not_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(GlmconvError, match="glmconv did not publish it .*; --force replaces only a directory glmconv "
                       "published: choose another OUT, or empty it$"):
        make_fixture(out, "tiny", force=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_empty_existing_out_is_filled(tmp_path):
    (tmp_path / "empty").mkdir()
    assert (make_fixture(tmp_path / "empty") / "config.json").exists()


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(plan, seed, *, init):
        yield from []
        raise RuntimeError("boom")

    monkeypatch.setattr(generate, "fixture_tensors", boom)
    with pytest.raises(RuntimeError):
        make_fixture(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --- ShardWriter -----------------------------------------------------------------------------------------

def test_shard_writer_bounds_shards_and_writes_the_index(tmp_path):
    with ShardWriter(tmp_path, max_shard_bytes=100) as w:
        w.add("a", torch.zeros(10))  # 40 bytes
        w.add("b", torch.zeros(10))  # 80
        w.add("c", torch.zeros(10))  # 120 > 100: new shard
        w.add("big", torch.zeros(50))  # 200 bytes: its own shard
    index = hf.index(tmp_path)
    assert index["metadata"]["total_size"] == 40 * 3 + 200
    files = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["weight_map"] == {"a": files[0], "b": files[0], "c": files[1], "big": files[2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == [*files, INDEX_NAME]


def test_shard_writer_refuses_duplicate_names(tmp_path):
    w = ShardWriter(tmp_path, max_shard_bytes=16)
    w.add("a", torch.zeros(8))
    w.add("b", torch.zeros(8))  # "a" is flushed to disk by now
    for name in ("a", "b"):
        with pytest.raises(GlmconvError, match="written twice"):
            w.add(name, torch.zeros(1))


def test_shard_writer_abort_removes_its_shards(tmp_path):
    with pytest.raises(ValueError):
        with ShardWriter(tmp_path, max_shard_bytes=4) as w:
            w.add("a", torch.zeros(2))
            w.add("b", torch.zeros(2))
            raise ValueError
    assert list(tmp_path.iterdir()) == []


# --- CLI -------------------------------------------------------------------------------------------------

def test_cli_make_prints_a_json_summary(tmp_path):
    res = CliRunner().invoke(fixture, ["make", str(tmp_path / "f"), "--preset", "tiny", "--fp8", "--seed", "3",
                                       "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["path"] == str(tmp_path / "f") and (out["preset"], out["fp8"], out["seed"]) == ("tiny", True, 3)
    assert out["tensors"] == len(hf.headers(tmp_path / "f"))
    assert out["shards"] == len(list((tmp_path / "f").glob("*.safetensors")))
    assert out["bytes"] == hf.index(tmp_path / "f")["metadata"]["total_size"]


def test_cli_make_prints_one_line(tmp_path):
    res = CliRunner().invoke(fixture, ["make", str(tmp_path / "f"), "--preset", "cut8"])
    assert res.exit_code == 0 and res.output.count("\n") == 1 and "cut8 bf16 seed 0" in res.output


def test_cli_refusal_is_one_error_line_and_exit_2(tmp_path):
    from glmconv_cli.main import cli

    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "x").write_text("")
    res = CliRunner().invoke(cli, ["fixture", "make", str(tmp_path / "f")])
    assert res.exit_code == 2 and isinstance(FixtureError("x"), GlmconvError)
    assert res.output.startswith("error: ") and res.output.count("\n") == 1
    assert res.output.endswith(": choose another OUT, or empty it\n") and "--force" not in res.output  # not glmconv's
