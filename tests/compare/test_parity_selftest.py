"""The calibrated verdict on the real models (tiny and cut8, fp32 and bf16, both modes): an aligned pair passes,
every planted defect of the catalog is named at its layer and sub-block (weight defects with their tensor), and
the default run's measured attribution adds up to its observed error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import glmconv.compare as parity_mod
from glmconv.compare import ParityOptions
from glmconv.compare.catalog import CATALOG, NAMES, select
from glmconv.errors import GlmconvError
from glmconv_cli.main import cli

MODES, DTYPES = ("isolated", "propagated"), ("fp32", "bf16")
LONG = dict(tokens=128, sequences=2)  # 64-token sequences: longer than index_topk (16), so the indexer selects


def _convert(hf: Path, out: Path) -> Path:
    res = CliRunner().invoke(cli, ["convert", str(hf), str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def pairs(tiny_ckpt: Path, cut8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("selftest")
    return {"tiny": (tiny_ckpt, _convert(tiny_ckpt, d / "mc-tiny")),
            "cut8": (cut8_ckpt, _convert(cut8_ckpt, d / "mc-cut8"))}


def _parity(pair: tuple[Path, Path], **kw: Any) -> dict:
    hf, mc = pair
    return parity_mod.run_parity(ParityOptions(hf_dir=hf, mcore_dir=mc, progress=False, **{**LONG, **kw}))


@pytest.mark.parametrize("fixture", ["tiny", "cut8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_aligned_pair_passes_and_every_planted_defect_is_named(pairs: dict, fixture: str, dtype: str,
                                                               mode: str) -> None:
    r = _parity(pairs[fixture], train_conventions="serve", dtype=dtype, mode=mode, self_test=True)
    assert r["first_divergence"] is None and r["summary"]["divergences"] == 0.0
    assert all(rec["weights"] == "equal" and rec["ref_rel_err"] == 0.0 for rec in r["layers"])
    assert r["noise_measured"] == (dtype == "bf16")
    missed = [row["defect"] for row in r["self_test"] if not row["named"]]
    assert missed == [] and r["passed"]
    kernel_defects = [d.name for d in CATALOG if d.kind == "kernel"]  # no kernel path on the references
    assert [row["defect"] for row in r["self_test_skipped"]] == kernel_defects
    assert len(r["self_test"]) == len(CATALOG) - len(kernel_defects)
    for row in r["self_test"]:
        fd, planted = row["first_divergence"], row["planted_at"][0]
        if row["kind"] == "weights":
            assert (fd["layer"], fd["sub_block"]) == (planted["layer"], planted["sub_block"])
            assert fd["cause"] == "weights" and row["tensors"][0]["hf"] and row["tensors"][0]["megatron"]
        else:
            assert fd["cause"] == "conventions" and fd["switches"] == [_convention(row["defect"])]


def _convention(name: str) -> str:
    return next(d.convention for d in CATALOG if d.name == name)


def test_a_weight_defect_names_its_hf_and_megatron_tensor_and_rows(pairs: dict) -> None:
    r = _parity(pairs["tiny"], train_conventions="serve", mode="isolated", self_test=True,
                defects="kda-q-rows-permuted,experts-swapped,fc1-mis-split")
    rows = {row["defect"]: row for row in r["self_test"]}
    (q,) = rows["kda-q-rows-permuted"]["tensors"]
    assert q["field"] == "kda.q_proj" and q["hf"] == ["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert q["megatron"] == ["decoder.layers.0.self_attention.kda.q_proj.weight"] and q["rows"] == "0-7"
    experts = rows["experts-swapped"]["tensors"]
    assert [t["field"] for t in experts] == ["moe.experts.gate[expert 0]", "moe.experts.up[expert 0]",
                                             "moe.experts.down[expert 0]", "moe.experts.gate[expert 1]"]  # first 4
    assert experts[0]["megatron"] == ["decoder.layers.2.mlp.experts.experts.linear_fc1.weight[expert 0]"]
    gate = rows["fc1-mis-split"]["tensors"][0]
    assert gate["hf"] == ["model.language_model.layers.0.mlp.gate_proj.weight"]
    assert gate["megatron"] == ["decoder.layers.0.mlp.linear_fc1.weight[first half]"]


@pytest.mark.parametrize("mode", MODES)
def test_the_default_runs_attribution_adds_up_to_the_observed_error(pairs: dict, mode: str) -> None:
    r = _parity(pairs["tiny"], mode=mode)
    att, fd = r["attribution"], r["first_divergence"]
    assert (att["layer"], att["sub_block"]) == (fd["layer"], fd["sub_block"]) == (0, "attention")
    assert set(att["shares"]) == {"proj_rms=megatron", "hc_mix=bf16"}
    total = sum(att["shares"].values()) + att["rest"]
    assert abs(total - fd["value"]) <= 0.2 * fd["value"]
    assert att["shares"]["proj_rms=megatron"] > 10 * att["shares"]["hc_mix=bf16"]  # the eps form dominates


def test_isolated_mode_never_blames_upstream_error(pairs: dict) -> None:
    r = _parity(pairs["tiny"], train_conventions="serve", mode="isolated",
                overrides=("proj_rms=megatron", "indexer_query=raw"))
    assert all(rec.get("cause") != "upstream" for rec in r["layers"])
    assert r["indexer_divergence"]["explained_by"] == "switches"
    prop = _parity(pairs["tiny"], train_conventions="serve", overrides=("proj_rms=megatron",))
    assert prop["indexer_divergence"]["explained_by"] == "upstream"
    assert prop["layers"][-1]["cause"] == "conventions" and prop["layers"][2]["cause"] == "conventions"


def test_the_cli_exits_1_on_a_divergence_and_0_on_an_aligned_pair(pairs: dict) -> None:
    hf, mc = pairs["tiny"]
    ok = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--train-conventions", "serve", "--tokens", "64"])
    assert ok.exit_code == 0, ok.output
    assert "no divergence" in ok.output and "PASSED (the verdict)" in ok.output
    bad = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--train-conventions", "serve", "--tokens", "64",
                                   "--train-convention", "hc_mix=bf16"])
    assert bad.exit_code == 1 and "parity failed: first divergence: layer 0 attention" in bad.output


def test_cli_self_test_on_a_subset(pairs: dict) -> None:
    hf, mc = pairs["tiny"]
    res = CliRunner().invoke(cli, ["parity", str(hf), str(mc), "--train-conventions", "serve", "--tokens", "64",
                                   "--self-test", "--defects", "router-bias,convention-swiglu_clamp"])
    assert res.exit_code == 0, res.output
    assert "self-test: 2 of 2 planted defects named" in res.output
    assert "named  router-bias: planted at layer 2 mlp" in res.output


def test_unknown_defects_are_refused_with_the_catalog() -> None:
    with pytest.raises(GlmconvError, match="unknown nope .*kda-q-rows-permuted"):
        select("nope,router-bias")
    assert [d.name for d in select("router-bias")] == ["router-bias"] and len(select(None)) == len(NAMES)


def _rows_scaled_copy(src: Path, dst: Path, name: str, rows: slice, factor: float) -> Path:
    """A copy of an HF checkpoint with some rows of one tensor multiplied (same names, shapes, dtypes, shards)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            if name not in f.keys():
                continue
            tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
        t = tensors[name].clone()
        t[rows] = (t[rows].float() * factor).to(t.dtype)
        save_file({**tensors, name: t}, shard, metadata=meta)
        return dst
    raise AssertionError(f"{name} is not in {src}")


@pytest.mark.parametrize("rows,first_rows", [(slice(300, 302), False), (slice(0, 8), True)])
def test_embedding_rows_the_batch_never_reads_are_still_named(pairs: dict, tmp_path: Path, rows: slice,
                                                              first_rows: bool) -> None:
    """A defect in rows the batch's tokens never look up is still a conversion defect; one in the fingerprint's
    own rows is named too, not refused as an unrelated checkpoint (the head's rows still agree)."""
    hf = pairs["tiny"][0]
    bad = _rows_scaled_copy(hf, tmp_path / "hf", "model.language_model.embed_tokens.weight", rows, 2.0)
    mc = _convert(bad, tmp_path / "mc")
    r = _parity((hf, mc), train_conventions="serve", tokens=8, sequences=1)
    fd = r["first_divergence"]
    assert (fd["layer"], fd["sub_block"], fd["cause"]) == (None, "embed", "weights") and not r["passed"]
    (d,) = fd["weight_diffs"]
    assert d["rows"] == f"{rows.start}-{rows.stop - 1}" and d["megatron"] == ["embedding.word_embeddings.weight"]
    assert d["hf"] == ["model.language_model.embed_tokens.weight"]


def _f32_copy(src: Path, dst: Path) -> Path:
    """A copy of an HF checkpoint with every BF16 tensor stored as F32 (as a trainer's fp32 save would)."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
        save_file({n: t.float() if t.dtype == torch.bfloat16 else t for n, t in tensors.items()}, shard, metadata=meta)
    index = dst / "model.safetensors.index.json"
    if index.exists():
        import json

        data = json.loads(index.read_text())
        data.get("metadata", {}).pop("total_size", None)
        index.write_text(json.dumps(data))
    return dst


def test_a_convert_dtype_bf16_pair_runs_against_the_rounded_weights(pairs: dict, tmp_path: Path) -> None:
    """An F32 checkpoint converted with `--dtype bf16`: parity reads the serve side's F32 tensors rounded as the
    train side holds them, so the pair agrees exactly (and says how many it rounded)."""
    hf = _f32_copy(pairs["tiny"][0], tmp_path / "hf32")
    res = CliRunner().invoke(cli, ["convert", str(hf), str(tmp_path / "mc"), "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    r = _parity((hf, tmp_path / "mc"), train_conventions="serve")
    assert r["first_divergence"] is None and r["passed"] and r["serve_rounded_to_bf16"] > 100
    assert all(rec["rel_err"] == 0.0 and rec["weights"] == "equal" for rec in r["layers"])
