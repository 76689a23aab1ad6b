"""Parity on either Megatron layout: the layout changes names only; the mcore layout's trainer runs without kpool.

The tiny preset has index_topk 16 (4 pools of 4) and one DSA layer, 3. Sequences of 64 tokens are longer than
index_topk, where megatron-core's token-level indexer (`indexer_kpool=off`, the mcore layout's train default)
selects other tokens than the learned kpool indexer; sequences of 16 are not, and both take every visible token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import glmconv.compare as parity_mod
from glmconv.compare import ParityOptions
from glmconv_cli.main import cli

LONG = {"tokens": 128, "sequences": 2}  # 64 tokens a sequence > index_topk 16
SHORT = {"tokens": 128, "sequences": 8}  # 16 tokens a sequence = index_topk
DSA_ATTENTION = 6  # layer 3's attention record
TIMES = ("wall_s", "load_s")


def _convert(hf: Path, out: Path, layout: str) -> Path:
    res = CliRunner().invoke(cli, ["convert", str(hf), str(out), "--layout", layout])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("parity-layout")
    return {layout: _convert(tiny_ckpt, d / layout, layout) for layout in ("miles", "mcore")}


def _parity(hf: Path, mc: Path, **kw: object) -> dict:
    return parity_mod.run_parity(ParityOptions(hf_dir=hf, mcore_dir=mc, progress=False, **kw))  # type: ignore[arg-type]


def _measured(report: dict) -> tuple[list[dict], dict]:
    return [{k: v for k, v in rec.items() if k not in TIMES} for rec in report["layers"]], report["logits"]


def test_mcore_layout_with_the_kpool_indexer_equals_miles_bit_for_bit(tiny_ckpt: Path,
                                                                      converted: dict[str, Path]) -> None:
    """Default (Megatron) conventions on both, the mcore side told to run the learned kpool indexer: every
    rel err, overlap and logit metric is the same float (the three q/k/v convs read as miles' fused one)."""
    kw = {**LONG, "overrides": ("indexer_kpool=learned",)}
    miles, mcore = (_parity(tiny_ckpt, converted[layout], **kw) for layout in ("miles", "mcore"))
    assert (miles["train_layout"], mcore["train_layout"]) == ("miles", "mcore")
    assert mcore["conventions"] == miles["conventions"] and mcore["conventions"]["train"]["proj_rms"] == "megatron"
    assert _measured(mcore) == _measured(miles)
    assert miles["layers"][0]["rel_err"] > 1e-2  # not a vacuous comparison: the Megatron defaults diverge


def test_mcore_default_flags_the_dsa_layer_when_sequences_exceed_index_topk(tiny_ckpt: Path,
                                                                           converted: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["parity", str(tiny_ckpt), str(converted["mcore"]), "--tokens", "128",
                                   "--sequences", "2", "--report-dir", str(tmp_path)])
    assert res.exit_code == 1, res.output  # the Megatron defaults diverge: the verdict fails the run
    assert "indexer selections first differ at layer 3" in res.output and "indexer_kpool=off" in res.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["train_layout"] == "mcore" and report["conventions"]["train"]["indexer_kpool"] == "off"
    assert report["conventions"]["serve"]["indexer_kpool"] == "learned"
    ix = report["indexer_divergence"]
    assert (ix["layer"], ix["metric"]) == (3, "topk_overlap") and "indexer_kpool=off" in ix["switches"]
    assert ix["value"] == report["layers"][DSA_ATTENTION]["topk_overlap"] < 1.0
    md = (tmp_path / "report.md").read_text()
    assert "(mcore layout)" in md and "| indexer_kpool | learned | off (differs) |" in md


def test_kpool_off_alone_diverges_first_at_the_dsa_layer(tiny_ckpt: Path, converted: dict[str, Path]) -> None:
    """Every other switch aligned: layers 0-2 are bit-identical and the first divergence is layer 3's attention,
    named with the one switch acting there; its selection overlap is below 1 (and so is its rel err's cause)."""
    r = _parity(tiny_ckpt, converted["mcore"], **LONG, train_conventions="serve", overrides=("indexer_kpool=off",))
    fd = r["first_divergence"]
    assert (fd["layer"], fd["sub_block"]) == (3, "attention") and fd["value"] > 1e-2
    assert r["first_divergence_switches"] == ["indexer_kpool=off"]
    assert all(rec["rel_err"] == 0.0 for rec in r["layers"][:DSA_ATTENTION])
    assert r["layers"][DSA_ATTENTION]["topk_overlap"] < 1.0
    assert r["indexer_divergence"]["switches"] == ["indexer_kpool=off"]


def test_kpool_off_selects_what_serve_does_in_sequences_up_to_index_topk(tiny_ckpt: Path,
                                                                         converted: dict[str, Path]) -> None:
    r = _parity(tiny_ckpt, converted["mcore"], **SHORT, train_conventions="serve", overrides=("indexer_kpool=off",))
    assert r["layers"][DSA_ATTENTION]["topk_overlap"] == 1.0 and r["indexer_divergence"] is None
    assert r["first_divergence"] is None and r["summary"]["max_rel_err"] <= 1e-6  # summation order only
    assert r["logits"]["top1_agreement"] == 1.0


def test_kpool_off_never_reads_the_kept_compress_tensors(converted: dict[str, Path]) -> None:
    from glmconv.models.conventions import Conventions
    from glmconv.models.model import GlmModel
    from glmconv.models.weights import MegatronWeights
    from glmconv.rules import roles as R

    src = MegatronWeights(converted["mcore"])
    read: list[str] = []
    tensor = src.tensor
    src.tensor = lambda layer, role: read.append(role) or tensor(layer, role)  # type: ignore[method-assign]
    model = GlmModel(src.config, src, Conventions.train_default(layout=src.layout))
    assert model.conventions.indexer_kpool == "off"
    with torch.inference_mode():
        logits = model.forward(torch.arange(40) % 500, torch.tensor([0, 40], dtype=torch.int32))
    assert bool(logits.isfinite().all()) and R.INDEXER_WQ_B in read
    assert not {R.INDEXER_COMPRESS_GATE, R.INDEXER_COMPRESS_APE} & set(read)
