"""export reads, transforms and FP8-encodes on threads ahead of its writer: the shards are the serial path's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.hf_helpers import raw_tensors

from glmconv import api
from glmconv.runners import export as export_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def mcs(tiny_ckpt: Path, tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export_pipeline")
    for name, src in (("tiny", tiny_ckpt), ("tiny-fp8", tiny_fp8_ckpt)):
        api.convert(src, root / name)
    return {"tiny": root / "tiny", "tiny-fp8": root / "tiny-fp8"}


def _export(mc: Path, out: Path, **opts: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    job = export_mod.prepare(mc, out, fp8=opts.pop("fp8", False), max_shard_bytes=300_000)
    summary = export_mod.export(job, export_mod.ExportOptions(progress=False, **opts))
    return summary, {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".safetensors"}


@pytest.mark.parametrize("fp8", [False, True])
def test_threads_ahead_write_the_serial_paths_shards_byte_for_byte(mcs: dict[str, Path], fp8: bool,
                                                                   tmp_path: Path) -> None:
    mc = mcs["tiny-fp8" if fp8 else "tiny"]
    serial, want = _export(mc, tmp_path / "serial", fp8=fp8, threads=0, zero_copy=False)
    ahead, got = _export(mc, tmp_path / "ahead", fp8=fp8, threads=4, ahead_bytes=50_000, zero_copy=False)
    assert got.keys() == want.keys() and len(got) >= 4
    assert [n for n in want if got[n] != want[n]] == []
    assert ahead["fp8_requantized"] == serial["fp8_requantized"]  # the stats, added to from every thread
    assert (ahead["bytes_in"], ahead["bytes_out"]) == (serial["bytes_in"], serial["bytes_out"])


def test_zero_copy_routes_and_computed_steps_interleave_in_plan_order(mcs: dict[str, Path], tmp_path: Path) -> None:
    _, want = _export(mcs["tiny"], tmp_path / "serial", threads=0, zero_copy=False)
    _, got = _export(mcs["tiny"], tmp_path / "mixed", threads=3, zero_copy=True)
    assert [n for n in want if got[n] != want[n]] == []


def test_fp8_export_round_trips_the_release_with_threads(mcs: dict[str, Path], tiny_fp8_ckpt: Path,
                                                         tmp_path: Path) -> None:
    api.export(mcs["tiny-fp8"], tmp_path / "hf", fp8=True, like=tiny_fp8_ckpt, read_threads=4)
    src, got = raw_tensors(tiny_fp8_ckpt), raw_tensors(tmp_path / "hf")
    assert got.keys() == src.keys() and [n for n in src if got[n] != src[n]] == []


def test_auto_workers_is_one_worker_for_export_with_and_without_fp8(mcs: dict[str, Path], tmp_path: Path) -> None:
    plain = api.export(mcs["tiny"], tmp_path / "plain", workers="auto", dry_run=True)
    fp8 = api.export(mcs["tiny-fp8"], tmp_path / "fp8", workers="auto", fp8=True, dry_run=True)
    assert (plain["workers"], fp8["workers"]) == (1, 1)


def test_read_threads_is_a_cli_option_with_a_range(mcs: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from glmconv_cli.main import cli

    bad = CliRunner().invoke(cli, ["export", str(mcs["tiny"]), str(tmp_path / "a"), "--read-threads", "65"])
    good = CliRunner().invoke(cli, ["export", str(mcs["tiny"]), str(tmp_path / "b"), "--read-threads", "0",
                                    "--workers", "auto", "--json"])
    assert bad.exit_code == 2 and "65 is not in the range 0<=x<=64" in bad.output
    assert good.exit_code == 0, good.output
