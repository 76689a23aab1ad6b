"""The `bench` fixture preset: a checkpoint of a requested size in the release's layout, that audits and converts."""

from __future__ import annotations

import json
from pathlib import Path

import hf_helpers as hf
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from glmconv.config import DSA, KDA, MOE, parse_config
from glmconv.fixtures import FixtureError, bench, make_fixture, preset_config
from glmconv.plan import FP8, build_plan
from glmconv.rules import names
from glmconv.rules import roles as R
from glmconv.runners.audit import audit
from glmconv_cli.fixture_cmd import fixture

SIZE = 20 * 10**6


@pytest.fixture(scope="module")
def bench_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fixture(tmp_path_factory.mktemp("bench") / "b20", "bench", size=SIZE, seed=0)


@pytest.fixture(scope="module")
def bench_fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fixture(tmp_path_factory.mktemp("bench") / "b20-fp8", "bench", fp8=True, size=SIZE, seed=0)


@pytest.mark.parametrize("which", ["bench_ckpt", "bench_fp8_ckpt"])
def test_size_is_within_ten_percent_and_there_are_several_shards(which, request):
    path = request.getfixturevalue(which)
    on_disk = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert abs(hf.index(path)["metadata"]["total_size"] - SIZE) <= 0.1 * SIZE
    assert abs(on_disk - SIZE) <= 0.1 * SIZE
    assert len(list(path.glob("*.safetensors"))) >= 3


@pytest.mark.parametrize("which,fp8", [("bench_ckpt", False), ("bench_fp8_ckpt", True)])
def test_audit_is_clean_and_layout_is_the_plan(which, fp8, request):
    path = request.getfixturevalue(which)
    report = audit(path)
    assert report.ok, report.findings[:3]
    cfg = json.loads((path / "config.json").read_text())
    plan = build_plan(parse_config(cfg), fp8=fp8)
    headers = hf.headers(path)
    assert headers == {n: (t.shape, t.dtype) for n, t in plan.hf_index.items()}
    assert all(n.startswith((names.HF_TEXT_PREFIX, names.HF_VISUAL_PREFIX, "lm_head.")) for n in headers)
    assert (sum(1 for _, d in headers.values() if d == FP8) > 0) == fp8
    gc = plan.config
    assert set(gc.attn_types) == {KDA, DSA} and MOE in gc.mlp_types and gc.num_mtp_layers == 1
    assert any(n.startswith(names.HF_VISUAL_PREFIX) for n in headers)


def test_bench_values_are_finite_and_never_all_zero(bench_ckpt):
    for shard in sorted(bench_ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                v = f.get_tensor(name).float()
                assert v.isfinite().all() and v.any(), name


def test_same_seed_same_bytes(bench_ckpt, tmp_path):
    again = make_fixture(tmp_path / "again", "bench", size=SIZE, seed=0)
    assert [p.read_bytes() for p in sorted(again.glob("*.safetensors"))] == \
        [p.read_bytes() for p in sorted(bench_ckpt.glob("*.safetensors"))]


@pytest.mark.parametrize("which", ["bench_ckpt", "bench_fp8_ckpt"])
def test_bench_fixture_converts(which, request, tmp_path):
    from glmconv.runners.convert import RunOptions, convert, prepare

    src = request.getfixturevalue(which)
    summary = convert(prepare(src, tmp_path / "out"), RunOptions(progress=False))
    assert summary["published"] == str(tmp_path / "out")
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_shapes_scale_with_size_and_fp8_keeps_the_tier():
    one, four = bench.bench_shape(10**9), bench.bench_shape(4 * 10**9)
    assert (one["hidden"], four["hidden"]) == (1024, 2048)
    assert bench.bench_shape(16 * 10**9)["hidden"] == 4096
    fp8 = bench.bench_shape(10**9, fp8=True)
    assert fp8["hidden"] == one["hidden"] and fp8["experts"] > one["experts"]
    for size in (10**9, 4 * 10**9):
        for f in (False, True):
            got = bench.config_bytes(bench.bench_config(size, fp8=f), f)
            assert 0.99 * size <= got <= size


from repo_files import REAL_CONFIG  # noqa: E402


def test_release_dims_at_hidden_4096():
    text, vision = bench.bench_text_and_vision(4096, 2, 8, 4096)
    want = {"hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
            "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256,
            "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128, "linear_num_heads": 64,
            "linear_head_dim": 128}
    assert {k: text[k] for k in want} == want
    assert {k: json.loads(REAL_CONFIG.read_text())["text_config"][k] for k in want} == want
    assert (vision["hidden_size"], vision["intermediate_size"], vision["num_heads"]) == (1024, 4096, 16)


def test_size_is_bench_only_and_too_small_is_refused():
    with pytest.raises(FixtureError, match="bench preset only"):
        preset_config("tiny", size=10**9)
    with pytest.raises(FixtureError, match="below the smallest bench model"):
        bench.bench_config(10**6)


def test_cli_make_bench_with_size(tmp_path):
    res = CliRunner().invoke(fixture, ["make", str(tmp_path / "b"), "--preset", "bench", "--size", "15MB",
                                       "--shard-size", "4MB", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["preset"] == "bench" and out["requested_bytes"] == 15 * 10**6
    assert abs(out["bytes"] - 15 * 10**6) <= 1.5 * 10**6 and out["shards"] >= 4
    res = CliRunner().invoke(fixture, ["make", str(tmp_path / "t"), "--preset", "tiny", "--size", "1GB"])
    assert res.exit_code != 0 and "bench preset" in res.output


def test_pool_windows_differ_per_tensor():
    pool = torch.randn(bench.POOL_ELEMS, dtype=torch.bfloat16)
    name = "model.language_model.layers.{}.mlp.down_proj.weight"
    a = bench._pooled(pool, name.format(0), R.DENSE_FC2, (512, 256), torch.bfloat16, 0)
    b = bench._pooled(pool, name.format(1), R.DENSE_FC2, (512, 256), torch.bfloat16, 0)
    assert a is not None and b is not None and not torch.equal(a, b)
    assert abs(a.float().std().item() - 256**-0.5) < 0.01
    assert bench._pooled(pool, "model.language_model.norm.weight", R.FINAL_NORM, (256,), torch.bfloat16, 0) is None
