"""`glmconv relayout`: torch_dist -> torch_dist between the miles and mcore layouts, bit for bit, zero-copy where
bytes only move, with the source's records carried so that export of the result equals export of the source."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import mcore_helpers as mh
from helpers.hf_helpers import raw_tensors

import glmconv
from glmconv.defaults import ZERO_COPY_ENV
from glmconv.errors import GlmconvError
from glmconv.io.file_names import CONFIG_NAME, MANIFEST_NAME, SIDECAR_DIR
from glmconv.io.torch_dist.common_state import read_common_state
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.runners import relayout as relayout_mod
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MILES, MCORE = "miles", "mcore"
OTHER = {MILES: MCORE, MCORE: MILES}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str], Path]:
    """`converted(hf, layout)`: the HF checkpoint converted in that layout, once per module."""
    made: dict[tuple[Path, str], Path] = {}

    def get(src: Path, layout: str) -> Path:
        if (src, layout) not in made:
            out = tmp_path_factory.mktemp("relayout") / f"{src.name}-{layout}"
            glmconv.convert(src, out, layout=layout)
            made[(src, layout)] = out
        return made[(src, layout)]

    return get


def _relayout(src: Path, out: Path, to: str, **opts: Any) -> dict[str, Any]:
    job = relayout_mod.prepare(src, out, to=to)
    return relayout_mod.relayout(job, relayout_mod.RelayoutOptions(progress=False, **opts))


def _objects(root: Path) -> list[str]:
    return sorted(DcpReader(root).ckpt.objects)


def _export(mc: Path, out: Path, **kw: Any) -> Path:
    glmconv.export(mc, out, **kw)
    return out


def _rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
             common: Callable[[dict[str, Any]], dict[str, Any]] = lambda c: c) -> Path:
    """A trainer's copy of a converted checkpoint: glmconv.json and the sidecars kept."""
    return mh.rewrite_dcp(src, dst, edit, common, keep=(CONFIG_NAME, MANIFEST_NAME, SIDECAR_DIR))


def _assert_same_tensors(got: Path, want: Path) -> None:
    a, b = mh.read_dcp(got), mh.read_dcp(want)
    assert sorted(a) == sorted(b)
    for name, t in b.items():
        mh.assert_same(name, a[name], t)


# ---- the tensors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_ckpt", "cut8_ckpt", "tiny_fp8_ckpt"])
@pytest.mark.parametrize("source", [MILES, MCORE])
def test_relayout_equals_convert_in_the_target_layout(fixture: str, source: str, request: pytest.FixtureRequest,
                                                      converted: Callable[[Path, str], Path], tmp_path: Path) -> None:
    hf = request.getfixturevalue(fixture)
    target = OTHER[source]
    summary = _relayout(converted(hf, source), tmp_path / "out", target)
    assert (summary["from"], summary["to"], summary["layout"]) == (source, target, target)
    _assert_same_tensors(tmp_path / "out", converted(hf, target))


@pytest.mark.parametrize("fixture", ["cut8_ckpt", "tiny_fp8_ckpt"])
def test_there_and_back_again_is_the_source_bit_for_bit(fixture: str, request: pytest.FixtureRequest,
                                                        converted: Callable[[Path, str], Path], tmp_path: Path) -> None:
    source = converted(request.getfixturevalue(fixture), MILES)
    _relayout(source, tmp_path / "mcore", MCORE)
    _relayout(tmp_path / "mcore", tmp_path / "back", MILES)
    _assert_same_tensors(tmp_path / "back", source)
    assert _objects(tmp_path / "back") == _objects(source)


def test_extra_state_objects_are_the_target_plans(tiny_ckpt: Path, converted: Callable[[Path, str], Path],
                                                  tmp_path: Path) -> None:
    _relayout(converted(tiny_ckpt, MILES), tmp_path / "out", MCORE)
    got, want = _objects(tmp_path / "out"), _objects(converted(tiny_ckpt, MCORE))
    assert got == want and len([k for k in got if "_extra_state" in k]) > 0
    assert got != _objects(converted(tiny_ckpt, MILES))  # the object keys follow the layout's names


@pytest.mark.parametrize("source", [MILES, MCORE])
def test_common_state_is_the_targets_with_the_sources_args(source: str, tiny_ckpt: Path,
                                                           converted: Callable[[Path, str], Path],
                                                           tmp_path: Path) -> None:
    target = OTHER[source]
    _relayout(converted(tiny_ckpt, source), tmp_path / "out", target)
    got = read_common_state(tmp_path / "out" / "release")
    want = read_common_state(converted(tiny_ckpt, target) / "release")
    assert got["glmconv"] == want["glmconv"] == {"layout": target}
    assert got["args"].mtp_num_layers == (None if target == MCORE else 1)
    assert vars(got["args"]) == vars(want["args"])
    assert {k: v for k, v in got.items() if k != "args"} == {k: v for k, v in want.items() if k != "args"}


def test_a_trainers_args_and_iteration_are_kept(tiny_ckpt: Path, converted: Callable[[Path, str], Path],
                                                tmp_path: Path) -> None:
    def trained(common: dict[str, Any]) -> dict[str, Any]:
        common["args"].lr, common["iteration"] = 3e-4, 1234
        return common

    src = _rewrite(converted(tiny_ckpt, MILES), tmp_path / "trained", lambda ts: ts, trained)
    summary = _relayout(src, tmp_path / "out", MCORE)
    got = read_common_state(tmp_path / "out" / "release")
    assert (got["iteration"], got["args"].lr, got["args"].mtp_num_layers) == (1234, 3e-4, None)
    assert summary["iteration"] == 1234


def test_a_padded_vocabulary_keeps_its_padding_and_exports_unpadded(tiny_ckpt: Path,
                                                                    converted: Callable[[Path, str], Path],
                                                                    tmp_path: Path) -> None:
    plan = glmconv.build_plan(glmconv.load_config(tiny_ckpt))
    vocab = [m.mcore[0].name for m in plan.mappings if m.rule.shapes[0][0] == "vocab"]
    pads: dict[str, torch.Tensor] = {}

    def pad(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for n in vocab:
            pads[n] = torch.randn(128, ts[n].shape[1]).to(ts[n].dtype)
            ts[n] = torch.cat([ts[n], pads[n]])
        return ts

    src = _rewrite(converted(tiny_ckpt, MILES), tmp_path / "padded", pad)
    summary = _relayout(src, tmp_path / "out", MCORE)
    assert summary["vocab_padding_kept"] == {n: 640 for n in vocab}
    got = mh.read_dcp(tmp_path / "out")
    for n in vocab:
        assert got[n].shape[0] == 640 and torch.equal(got[n][512:].view(torch.int16), pads[n].view(torch.int16))
    assert raw_tensors(_export(tmp_path / "out", tmp_path / "hf")) == raw_tensors(tiny_ckpt)


# ---- export of the result --------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_ckpt", "cut8_ckpt"])
@pytest.mark.parametrize("source", [MILES, MCORE])
def test_export_of_the_relayouted_checkpoint_is_the_source_hf(fixture: str, source: str,
                                                              request: pytest.FixtureRequest,
                                                              converted: Callable[[Path, str], Path],
                                                              tmp_path: Path) -> None:
    hf = request.getfixturevalue(fixture)
    _relayout(converted(hf, source), tmp_path / "out", OTHER[source])
    out = _export(tmp_path / "out", tmp_path / "hf")
    assert raw_tensors(out) == raw_tensors(hf)  # names, restored dtypes (F32 where stored F32), bytes
    assert (out / "generation_config.json").read_bytes() == (hf / "generation_config.json").read_bytes()
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert (manifest["dtypes_from"], manifest["sidecars_from"]) == ("converted checkpoint", "converted checkpoint")


def test_fp8_export_of_the_relayouted_checkpoint_equals_the_sources(tiny_fp8_ckpt: Path,
                                                                    converted: Callable[[Path, str], Path],
                                                                    tmp_path: Path) -> None:
    _relayout(converted(tiny_fp8_ckpt, MILES), tmp_path / "out", MCORE)
    got = _export(tmp_path / "out", tmp_path / "hf", fp8=True)
    want = _export(converted(tiny_fp8_ckpt, MILES), tmp_path / "hf-direct", fp8=True)
    assert raw_tensors(got) == raw_tensors(want)
    fp8 = {n for n, (dtype, _, _) in raw_tensors(got).items() if dtype == "F8_E4M3"}
    assert len(fp8) == 95 and raw_tensors(got).keys() == raw_tensors(tiny_fp8_ckpt).keys()
    src = raw_tensors(tiny_fp8_ckpt)
    assert [n for n in fp8 if raw_tensors(got)[n] != src[n]] == []  # every e4m3 code is the release's
    assert json.loads((got / CONFIG_NAME).read_text())["quantization_config"] == \
        json.loads((tiny_fp8_ckpt / CONFIG_NAME).read_text())["quantization_config"]


def test_manifest_carries_the_sources_records(tiny_fp8_ckpt: Path, converted: Callable[[Path, str], Path],
                                              tmp_path: Path) -> None:
    src = converted(tiny_fp8_ckpt, MILES)
    _relayout(src, tmp_path / "out", MCORE)
    got = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    old = json.loads((src / MANIFEST_NAME).read_text())
    for key in ("hf_dtypes", "sidecars", "text_prefix", "fp8_source", "hf_tensors"):
        assert got[key] == old[key], key
    assert got["fp8_source"] is True and got["sidecars"] == {"generation_config.json": old["sidecars"][
        "generation_config.json"]}
    assert (got["layout"], got["relayout_from"], got["written_by"]) == (MCORE, MILES, "glmconv")
    assert got["homeless"] == {"indexer.compress_gate": 1, "indexer.compress_ape": 1, "mtp": 49, "vision": 39}
    assert got["mcore_tensors"] == len(mh.read_dcp(tmp_path / "out"))


# ---- zero-copy -------------------------------------------------------------------------------------------

def test_bytes_that_only_move_are_copied_file_to_file(cut8_ckpt: Path, converted: Callable[[Path, str], Path],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copied: list[int] = []
    real = os.copy_file_range

    def never(*a: object, **k: object) -> None:
        raise AssertionError("a tensor was read through torch.load")

    monkeypatch.setattr(os, "copy_file_range", lambda *a: copied.append(real(*a)) or copied[-1])
    monkeypatch.setattr(DcpReader, "read", never)
    summary = _relayout(converted(cut8_ckpt, MILES), tmp_path / "out", MCORE)
    assert summary["computed_mappings"] == summary["bytes_read"] == 0
    assert summary["copied_mappings"] == summary["mappings"]
    assert sum(copied) >= summary["bytes_out"] == summary["bytes_copied"]


def test_without_zero_copy_tensors_are_read_and_rebuilt_to_the_same_bits(tiny_ckpt: Path,
                                                                         converted: Callable[[Path, str], Path],
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ZERO_COPY_ENV, "0")
    summary = _relayout(converted(tiny_ckpt, MCORE), tmp_path / "out", MILES)
    assert summary["copied_mappings"] == summary["bytes_copied"] == 0
    assert summary["computed_mappings"] == summary["mappings"] and summary["bytes_read"] == summary["bytes_in"]
    _assert_same_tensors(tmp_path / "out", converted(tiny_ckpt, MILES))


@pytest.mark.parametrize("zero_copy", [True, False])
def test_stacked_experts_move_a_few_rows_at_a_time(zero_copy: bool, tiny_ckpt: Path,
                                                   converted: Callable[[Path, str], Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = converted(tiny_ckpt, MILES)
    plan = glmconv.build_plan(glmconv.load_config(src))
    experts = [m for m in plan.mappings if m.by_rows]
    row_bytes = experts[0].mcore_bytes // experts[0].mcore[0].shape[0]
    reads: list[tuple[str, Any]] = []
    read = DcpReader.read
    monkeypatch.setattr(DcpReader, "read", lambda self, n, rows=None: reads.append((n, rows)) or read(self, n, rows))
    _relayout(src, tmp_path / "out", MCORE, chunk_bytes=2 * row_bytes, zero_copy=zero_copy)
    chunks = DcpReader(tmp_path / "out").chunks(experts[0].mcore[0].name)  # stored an expert each (DcpWriter)
    assert len(chunks) == experts[0].mcore[0].shape[0] and all(s[0] == 1 for _, s in chunks)
    first, stacked = experts[0].mcore[0], {m.mcore[0].name: m.mcore[0].shape[0] for m in experts}
    assert [r for n, r in reads if n == first.name and (r is None or r[1] - r[0] != 2)] == []
    assert [n for n, r in reads if n in stacked and (r is None or r[1] - r[0] == stacked[n])] == []  # never whole
    assert bool(reads) is not zero_copy
    _assert_same_tensors(tmp_path / "out", converted(tiny_ckpt, MCORE))


# ---- refusals and the command line ---------------------------------------------------------------------

def test_the_layout_the_source_has_is_refused(tiny_ckpt: Path, converted: Callable[[Path, str], Path],
                                              tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["relayout", str(converted(tiny_ckpt, MILES)), str(tmp_path / "out"),
                                   "--to", MILES])
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"error: {converted(tiny_ckpt, MILES)}: already in the miles layout; relayout --to miles would only copy "
        "it (cp -r does that)"]
    assert not (tmp_path / "out").exists()


def test_an_hf_source_is_refused_naming_convert(tiny_ckpt: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["relayout", str(tiny_ckpt), str(tmp_path / "out"), "--to", MCORE])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.stderr.strip() == (f"error: {tiny_ckpt}: this is an HF checkpoint, but relayout takes a torch_dist "
                                  f"checkpoint as MCORE_DIR; did you mean `glmconv convert {tiny_ckpt} OUT_DIR`?")


def test_out_inside_the_input_is_refused_before_anything_is_read(tiny_ckpt: Path,
                                                                 converted: Callable[[Path, str], Path]) -> None:
    src = converted(tiny_ckpt, MILES)
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(GlmconvError, match="OUT is inside the input"):
        relayout_mod.prepare(src, src / "inside", to=MCORE)
    assert sorted(p.name for p in src.iterdir()) == before


def test_the_homeless_warning_goes_to_stderr_and_json_to_stdout(tiny_ckpt: Path,
                                                                converted: Callable[[Path, str], Path],
                                                                tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["relayout", str(converted(tiny_ckpt, MILES)), str(tmp_path / "out"), "--to",
                                   MCORE, "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert res.stderr.strip() == summary["homeless_warning"]
    assert res.stderr.startswith("warning: the mcore layout has no parameter for the kpool compress_gate (1 tensor)")
    back = CliRunner().invoke(cli, ["relayout", str(tmp_path / "out"), str(tmp_path / "back"), "--to", MILES,
                                    "--json"])
    assert back.exit_code == 0 and back.stderr == "" and json.loads(back.stdout)["homeless"] == {}


def test_dry_run_writes_nothing(tiny_ckpt: Path, converted: Callable[[Path, str], Path], tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["relayout", str(converted(tiny_ckpt, MILES)), str(tmp_path / "out"), "--to",
                                   MCORE, "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0] == ("would rewrite 185 Megatron tensors (miles, 0.001 GB) -> 191 Megatron "
                                          "tensors (mcore, 0.001 GB)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_megatron_objects_in_a_trainers_common_state_are_carried(converted: Callable[[Path, str], Path],
                                                                 tiny_ckpt: Path, tmp_path: Path) -> None:
    import argparse

    from glmconv.io.torch_dist.pickle_allow import OpaqueValue

    # what the reader makes of an allow-listed megatron enum in a trainer's args when megatron is not imported;
    # written back as the global it stands for (tests/io/test_common_state_write_back.py loads it in megatron)
    stand_in = type("AttnBackend", (OpaqueValue,), {"qualname": "megatron.core.transformer.enums.AttnBackend"})

    def trained(common: dict[str, Any]) -> dict[str, Any]:
        args = argparse.Namespace(**vars(common["args"]), attention_backend=stand_in(5))
        return {**common, "args": args, "iteration": 7}

    src = _rewrite(converted(tiny_ckpt, MILES), tmp_path / "trained", lambda ts: ts, trained)
    _relayout(src, tmp_path / "out", MCORE)
    got = read_common_state(DcpReader(tmp_path / "out").iter_dir)
    backend = got["args"].attention_backend
    # a stand-in again, or the real enum where a test before this one in this process imported megatron (its
    # import registers the real classes with torch's weights_only unpickler)
    found = ((backend.qualname, backend.args[0]) if isinstance(backend, OpaqueValue)
             else (f"{type(backend).__module__}.{type(backend).__qualname__}", backend.value))
    assert (*found, got["iteration"]) == ("megatron.core.transformer.enums.AttnBackend", 5, 7)
