"""The gate sees the trainer's kernels (the kernel path emulated by the references, `--kernels emulated`, on tiny
and cut8, fp32 and bf16, both modes): the aligned pair passes with every kernel check at 0; every kernel-path
defect of the catalog, planted in the kernel path alone, fails the gate at its layer and sub-block with cause
`kernel` and its kernel named; weight and convention defects are named as before; a defect that only raises the
kernels' own error (no noise floor can absorb it) is caught although the streams stay inside the old noise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import glmconv.compare as parity_mod
from glmconv.compare import ParityOptions
from glmconv.compare.catalog import CATALOG
from glmconv_cli.main import cli

MODES, DTYPES = ("isolated", "propagated"), ("fp32", "bf16")
LONG = dict(tokens=128, sequences=2)  # 64-token sequences: longer than index_topk (16), so the indexer selects
KERNEL_DEFECTS = {d.name: d for d in CATALOG if d.kind == "kernel"}


@pytest.fixture(scope="module")
def pairs(tiny_ckpt: Path, cut8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("kernel-verdict")
    out = {}
    for name, hf in (("tiny", tiny_ckpt), ("cut8", cut8_ckpt)):
        res = CliRunner().invoke(cli, ["convert", str(hf), str(d / name)])
        assert res.exit_code == 0, res.output
        out[name] = (hf, d / name)
    return out


def _parity(pair: tuple[Path, Path], **kw: Any) -> dict:
    hf, mc = pair
    opts = {**LONG, "train_conventions": "serve", "kernels": "emulated", **kw}
    return parity_mod.run_parity(ParityOptions(hf_dir=hf, mcore_dir=mc, progress=False, **opts))


@pytest.mark.parametrize("fixture", ["tiny", "cut8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_aligned_passes_and_every_kernel_defect_is_named_as_its_kernel(pairs: dict, fixture: str, dtype: str,
                                                                        mode: str) -> None:
    r = _parity(pairs[fixture], dtype=dtype, mode=mode, self_test=True, defects=",".join(KERNEL_DEFECTS))
    assert r["kernels"] == "kernels" and r["first_divergence"] is None and r["passed"]
    checks = [c for rec in r["layers"] for c in rec.get("kernels", ())]
    assert {c["op"] for c in checks} == {"short_conv", "kda_core", "indexer", "sparse_mla"}
    assert all(c["ratio"] == 0.0 and c["within"] for c in checks)  # the references against themselves
    assert r["self_test_skipped"] == [] and [row["defect"] for row in r["self_test"]] == list(KERNEL_DEFECTS)
    assert [row["defect"] for row in r["self_test"] if not row["named"]] == []
    _check_rows(r)


def test_the_whole_catalog_in_one_pass_on_the_kernel_path(pairs: dict) -> None:
    """Weight and convention defects are named as before beside the kernel-path ones (bf16: the noisiest run)."""
    r = _parity(pairs["tiny"], dtype="bf16", mode="propagated", self_test=True)
    assert r["passed"] and len(r["self_test"]) == len(CATALOG) and r["self_test_skipped"] == []
    assert [row["defect"] for row in r["self_test"] if not row["named"]] == []
    _check_rows(r)


def _check_rows(r: dict) -> None:
    """Each planted defect named where it was planted, with its cause (a kernel defect: its kernel)."""
    for row in r["self_test"]:
        fd = row["first_divergence"]
        assert (fd["layer"], fd["sub_block"]) == (row["planted_at"][0]["layer"], row["planted_at"][0]["sub_block"])
        if row["kind"] == "kernel":
            defect = KERNEL_DEFECTS[row["defect"]]
            assert fd["cause"] == "kernel" and fd["kernel"]["op"] == defect.op and not fd["kernel"]["within"]
            assert fd["kernel"]["kernel"].endswith(("causal_conv1d", "chunk_kda", "kpool indexer", "SparseMLA"))
            assert fd["ref_rel_err"] == 0.0  # the references untouched: only the kernel path differs
        else:
            assert fd["cause"] == row["kind"].replace("convention", "conventions")


def test_a_kernel_defect_inside_the_streams_noise_is_still_caught(pairs: dict) -> None:
    """The ids in token order select the same set: the streams do not move at all, the indexer check does."""
    r = _parity(pairs["tiny"], dtype="bf16", mode="isolated", self_test=True, defects="kernel-indexer-unsorted")
    row, = r["self_test"]
    fd = row["first_divergence"]
    assert row["named"] and fd["excess"] < 1.0 and fd["why"] == ["kernel beyond its bound"]
    assert fd["kernel"]["metric"] == "mismatch" and fd["kernel"]["overlap"] == 1.0 and fd["kernel"]["mismatch"] > 0.5


def test_the_noise_floor_excludes_a_kernel_beyond_its_bound(pairs: dict) -> None:
    """The kernel's error is not the noise it is judged against: the defect's record keeps the clean noise of
    correct code, with no allowance for the kernel."""
    clean = _parity(pairs["tiny"], dtype="bf16", mode="isolated")
    r = _parity(pairs["tiny"], dtype="bf16", mode="isolated", self_test=True,
                defects="kernel-kda-dt-bias-dropped")
    fd = r["self_test"][0]["first_divergence"]
    at = next(rec for rec in clean["layers"] if (rec["layer"], rec["sub_block"]) == (fd["layer"], fd["sub_block"]))
    assert fd["noise"] == pytest.approx(at["noise_serve"] + at["noise_train"]) and at["noise_kernel"] == 0.0
    assert fd["excess"] > 10 and "rel err beyond noise" in fd["why"]


def test_a_reference_run_has_no_kernel_column_and_says_so(pairs: dict) -> None:
    from glmconv.compare.report import to_markdown

    r = _parity(pairs["tiny"], kernels="reference", self_test=True, defects="kernel-sparse-mla-scale,norm-offset")
    assert r["kernels"] == "reference" and not any("kernels" in rec for rec in r["layers"])
    assert [row["defect"] for row in r["self_test"]] == ["norm-offset"] and r["passed"]
    assert [row["defect"] for row in r["self_test_skipped"]] == ["kernel-sparse-mla-scale"]
    md = to_markdown(r)
    assert "| kernel |" not in md and "kernels: none checked (the train side ran the torch references" in md
    assert "not planted: 1 defect (kernel-sparse-mla-scale)" in md


@pytest.mark.parametrize("replay", ["indexer", "both"])
def test_replay_and_the_mcore_layout_keep_working_with_kernels(pairs: dict, replay: str, tmp_path: Path) -> None:
    """Replayed selections are not judged; the indexer kernel is still checked on what it selected itself."""
    r = _parity(pairs["tiny"], dtype="bf16", replay=replay, self_test=True, defects="kernel-indexer-truncated")
    assert r["passed"] and r["self_test"][0]["named"]
    dsa = [rec for rec in r["layers"] if rec["attn_type"] == "dsa" and rec["sub_block"] == "attention"]
    assert all(rec["replayed"] == "topk" and "indexer" in [c["op"] for c in rec["kernels"]] for rec in dsa)
    res = CliRunner().invoke(cli, ["relayout", str(pairs["tiny"][1]), str(tmp_path / "native"), "--to", "mcore"])
    assert res.exit_code == 0, res.output
    native = _parity((pairs["tiny"][0], tmp_path / "native"), dtype="bf16", overrides=("indexer_kpool=learned",),
                     self_test=True, defects="kernel-indexer-ids-off-by-one")
    assert native["passed"] and native["train_layout"] == "mcore" and native["self_test"][0]["named"]


@pytest.mark.parametrize("fixture", ["tiny", "cut8"])
def test_a_bf16_run_hands_no_norm_or_linear_a_mix_of_dtypes_that_cuda_refuses(pairs: dict, fixture: str) -> None:
    """Both sides of a bf16 run, the kernel path included: every norm and linear sees one floating dtype (CUDA's
    kernels refuse what the CPU's promote; tests/helpers/mixed_dtypes.py)."""
    from helpers.mixed_dtypes import MixedDtypes

    with MixedDtypes() as mixed:
        r = _parity(pairs[fixture], dtype="bf16", mode="propagated")
    assert r["passed"] and mixed.found == []


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # torch's own note on the CPU's mixed path
def test_the_mixed_dtype_watch_records_a_bf16_input_with_fp32_weights() -> None:
    import torch
    import torch.nn.functional as F
    from helpers.mixed_dtypes import MixedDtypes

    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.ones(8)
    with MixedDtypes() as mixed:
        F.layer_norm(x, (8,), w.bfloat16())
        F.rms_norm(x, (8,), w)
        F.linear(x.float(), torch.ones(2, 8))
    assert mixed.found == ["rms_norm: torch.bfloat16, torch.float32"]
