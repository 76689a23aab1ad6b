"""`convert --layout mcore`: round trips, the record of the layout, what it keeps, and reading either layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import mcore_helpers as mh
from helpers.hf_helpers import raw_tensors

from glmconv import api
from glmconv.errors import CheckpointError
from glmconv.io.file_names import MANIFEST_NAME
from glmconv.io.torch_dist.common_state import read_common_state
from glmconv.io.torch_dist.metadata import inspect_torch_dist
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
KEPT = "glmconv_kept."


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _convert(src: Path, out: Path, layout: str, **kw: Any) -> dict[str, Any]:
    return api.convert(src, out, layout=layout, **kw)


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tiny_fp8_ckpt: Path, cut8_ckpt: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, Any]]]:
    """fixture -> (HF source, its mcore-layout conversion, convert's summary)."""
    root = tmp_path_factory.mktemp("mcore_layout")
    out = {}
    for name, src in (("tiny", tiny_ckpt), ("tiny-fp8", tiny_fp8_ckpt), ("cut8", cut8_ckpt)):
        out[name] = (src, root / name, _convert(src, root / name, "mcore"))
    return out


@pytest.fixture(scope="module")
def tiny_miles(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("miles_layout") / "tiny"
    _convert(tiny_ckpt, out, "miles")
    return out


@pytest.mark.parametrize("name", ["tiny", "cut8"])
def test_bf16_round_trip_through_the_mcore_layout_is_byte_identical(name: str, converted: dict, tmp_path: Path) -> None:
    src, mc, _ = converted[name]
    summary = api.export(mc, tmp_path / "hf")
    got, want = raw_tensors(tmp_path / "hf"), raw_tensors(src)
    assert got.keys() == want.keys() and [n for n in want if got[n] != want[n]] == []
    assert summary["layout"] == "mcore"


def test_fp8_round_trip_through_the_mcore_layout_is_byte_identical(converted: dict, tmp_path: Path) -> None:
    src, mc, _ = converted["tiny-fp8"]
    api.export(mc, tmp_path / "hf", fp8=True, like=src)
    got, want = raw_tensors(tmp_path / "hf"), raw_tensors(src)
    assert got.keys() == want.keys() and [n for n in want if got[n] != want[n]] == []


@pytest.mark.parametrize("name", ["tiny", "tiny-fp8", "cut8"])
def test_verify_finds_every_mcore_layout_tensor_equal_to_its_source(name: str, converted: dict) -> None:
    src, mc, _ = converted[name]
    result = api.verify(src, mc)
    assert result["equal"] and result["mcore_tensors"] == len(inspect_torch_dist(mc).tensors)


def test_the_layout_is_recorded_in_the_manifest_and_the_common_state(converted: dict) -> None:
    _, mc, _ = converted["tiny"]
    common = read_common_state(inspect_torch_dist(mc).iter_dir)
    assert json.loads((mc / MANIFEST_NAME).read_text())["layout"] == "mcore"
    assert common["glmconv"] == {"layout": "mcore"}
    assert common["args"].mtp_num_layers is None  # the Bridge's model has no MTP module: the tensors are kept only


def test_what_the_layout_has_no_parameter_for_is_counted_and_kept(converted: dict) -> None:
    _, mc, summary = converted["tiny"]
    kept = sorted(n for n in inspect_torch_dist(mc).tensors if n.startswith(KEPT))
    assert summary["homeless"] == {"indexer.compress_gate": 1, "indexer.compress_ape": 1, "mtp": 49, "vision": 39}
    assert kept[:2] == [KEPT + "decoder.layers.3.self_attention.core_attention.indexer.index_kpool_compress_ape",
                        KEPT + "decoder.layers.3.self_attention.core_attention.indexer.index_kpool_compress_gate"]
    assert {n.split(".")[1] for n in kept} == {"decoder", "mtp", "vision_model"}
    assert "glmconv_kept." in summary["homeless_warning"] and "MTP layer (49 tensors)" in summary["homeless_warning"]


def test_the_same_tensors_hold_the_same_bytes_in_both_layouts(converted: dict, tiny_miles: Path) -> None:
    from glmconv.io.config_file import load_config
    from glmconv.plan import build_plan

    _, mc, _ = converted["tiny"]
    a, b = mh.read_dcp(tiny_miles), mh.read_dcp(mc)
    cfg = load_config(tiny_miles / "config.json")
    miles, mcore = build_plan(cfg), build_plan(cfg, layout="mcore")
    for m in miles.mappings:
        twin = mcore.mapping_of_key[m.key]
        mine = b"".join(_bytes(a[t.name]) for t in m.mcore)
        theirs = b"".join(_bytes(b[t.name]) for t in twin.mcore)
        assert mine == theirs, m.key  # the KDA conv: one packed tensor, or q, k and v in that order


def test_audit_compares_two_layouts_through_the_mapping(converted: dict, tiny_miles: Path) -> None:
    _, mc, _ = converted["tiny"]
    report = api.audit_report(mc, tiny_miles)
    assert report.ok, report.findings[:3]
    assert (report.plans["src"]["layout"], report.plans["against"]["layout"]) == ("mcore", "miles")


@pytest.mark.parametrize("name", ["tiny", "tiny-fp8", "cut8"])
def test_audit_of_the_source_against_its_mcore_conversion_is_clean_both_ways(name: str, converted: dict) -> None:
    src, mc, _ = converted[name]
    there, back = api.audit_report(src, mc), api.audit_report(mc, src)
    assert there.ok and back.ok, (there.findings[:3], back.findings[:3])
    assert there.plans["against"]["layout"] == back.plans["src"]["layout"] == "mcore"


def test_audit_names_a_tensor_the_mcore_conversion_lacks(converted: dict, tmp_path: Path) -> None:
    src, mc, _ = converted["tiny"]
    gone = "decoder.layers.0.self_attention.k_conv1d.weight"
    lacking = mh.rewrite_dcp(mc, tmp_path / "lacking", lambda ts: {n: t for n, t in ts.items() if n != gone},
                             keep=("config.json", MANIFEST_NAME))
    report = api.audit_report(src, lacking)
    assert [(f.kind, f.tensor, f.side) for f in report.findings] == [("missing", gone, "against")]


def test_audit_detects_the_layout_from_the_names_without_a_record(converted: dict, tmp_path: Path) -> None:
    _, mc, _ = converted["tiny"]
    bare = shutil.copytree(mc, tmp_path / "bare")
    (bare / MANIFEST_NAME).unlink()
    report = api.audit_report(bare)
    assert report.ok and report.plans["src"]["layout"] == "mcore"


def test_a_record_the_names_contradict_is_an_audit_finding_and_refused_by_export(converted: dict,
                                                                                 tmp_path: Path) -> None:
    _, mc, _ = converted["tiny"]
    lying = shutil.copytree(mc, tmp_path / "lying")
    manifest = json.loads((lying / MANIFEST_NAME).read_text())
    (lying / MANIFEST_NAME).write_text(json.dumps({**manifest, "layout": "miles"}))
    report = api.audit_report(lying)
    assert [(f.kind, f.found) for f in report.findings] == [("layout", "tensors named in the mcore layout")]
    with pytest.raises(CheckpointError, match="records the miles layout, but its tensors are named in the mcore"):
        api.export(lying, tmp_path / "hf")


def test_export_refuses_a_layout_flag_the_names_contradict(converted: dict, tmp_path: Path) -> None:
    _, mc, _ = converted["tiny"]
    with pytest.raises(CheckpointError, match="--layout miles, but its tensors are named in the mcore layout"):
        api.export(mc, tmp_path / "hf", layout="miles")


def test_no_mtp_leaves_nothing_of_it_kept(tiny_ckpt: Path, tmp_path: Path) -> None:
    summary = _convert(tiny_ckpt, tmp_path / "mc", "mcore", mtp=False, vision=False)
    assert summary["homeless"] == {"indexer.compress_gate": 1, "indexer.compress_ape": 1}
    assert not [n for n in inspect_torch_dist(tmp_path / "mc").tensors if ".mtp." in n or "mtp.layers" in n]


def test_the_cli_warns_on_stderr_even_with_json(tiny_ckpt: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["convert", str(tiny_ckpt), str(tmp_path / "mc"), "--layout", "mcore", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"] == "mcore"
    assert result.stderr.startswith("warning: the mcore layout has no parameter for the kpool compress_gate")


def test_an_unknown_layout_is_a_usage_error(tiny_ckpt: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["convert", str(tiny_ckpt), str(tmp_path / "mc"), "--layout", "nemo"])
    assert result.exit_code == 2 and "'nemo' is not one of 'miles', 'mcore'" in result.output
    assert not (tmp_path / "mc").exists()


def test_the_cli_audit_says_each_torch_dist_sides_layout_and_what_it_keeps(converted: dict, tiny_miles: Path) -> None:
    _, mc, _ = converted["tiny"]
    result = CliRunner().invoke(cli, ["audit-names", str(mc), "--against", str(tiny_miles)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["src: torch_dist in the mcore layout, 67 tensors kept under glmconv_kept.",
                                          "against: torch_dist in the miles layout", "OK: 376 tensors match the plan"]


def _bridge_saved(mc: Path, out: Path) -> Path:
    """What a trainer built by Megatron-Bridge saves: no glmconv_kept. tensor (no parameter holds them), no
    glmconv.json."""
    return mh.rewrite_dcp(mc, out, lambda ts: {n: t for n, t in ts.items() if not n.startswith(KEPT)})


def test_a_bridge_saved_checkpoint_exports_its_kpool_tensors_from_like(converted: dict, tmp_path: Path) -> None:
    src, mc, _ = converted["tiny"]
    summary = api.export(_bridge_saved(mc, tmp_path / "trained"), tmp_path / "hf", like=src)
    got, want = raw_tensors(tmp_path / "hf"), raw_tensors(src)
    kpool = ["model.language_model.layers.3.self_attn.indexer.index_kpool_compress_ape",
             "model.language_model.layers.3.self_attn.indexer.index_kpool_compress_gate"]
    assert summary["taken_from_like"] == kpool and (summary["mtp"], summary["vision"]) == (False, False)
    assert set(got) == {n for n in want if ".layers.4." not in n and ".visual." not in n}  # no MTP, no vision
    assert [n for n in got if got[n] != want[n]] == []  # the kpool tensors are --like's, bit for bit


def test_a_bridge_saved_checkpoint_without_like_is_refused_naming_the_tensor(converted: dict, tmp_path: Path) -> None:
    _, mc, _ = converted["tiny"]
    trained = _bridge_saved(mc, tmp_path / "trained")
    want = (f"^{KEPT}decoder.layers.3.self_attention.core_attention.indexer.index_kpool_compress_gate: missing from "
            ".*: the mcore layout has no trainer parameter for .*index_kpool_compress_gate, so a checkpoint its "
            "trainer saved has none; pass --like with the HF checkpoint training started from$")
    with pytest.raises(CheckpointError, match=want):
        api.export(trained, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_the_cli_says_what_it_took_from_like(converted: dict, tmp_path: Path) -> None:
    src, mc, _ = converted["tiny"]
    trained = _bridge_saved(mc, tmp_path / "trained")
    result = CliRunner().invoke(cli, ["export", str(trained), str(tmp_path / "hf"), "--like", str(src), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("warning: 2 HF tensors that the mcore layout has no trainer parameter for "
                                    "(indexer.compress_ape, indexer.compress_gate) are not in ")


def test_a_bridge_saved_checkpoint_relayouts_to_miles_with_its_kpool_from_like(converted: dict, tiny_miles: Path,
                                                                              tmp_path: Path) -> None:
    src, mc, _ = converted["tiny"]
    trained = _bridge_saved(mc, tmp_path / "trained")
    summary = api.relayout(trained, tmp_path / "miles", to="miles", like=src)
    got, want = mh.read_dcp(tmp_path / "miles"), mh.read_dcp(tiny_miles)
    assert len(summary["taken_from_like"]) == 2
    assert set(got) == {n for n in want if not n.startswith(("mtp.", "vision_model."))}
    assert [n for n in got if not torch.equal(got[n].view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8))
            or got[n].dtype != want[n].dtype] == []
    with pytest.raises(CheckpointError, match="pass --like with the HF checkpoint training started from"):
        api.relayout(trained, tmp_path / "no-like", to="miles")
