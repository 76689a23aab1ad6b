"""`convert --dry-run` and `export --dry-run`: a plan a user can act on (time, space), nothing written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from glmconv import space
from glmconv_cli.main import cli


def _json(*args: str) -> dict:
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dry-run") / "mc"
    _json("convert", str(tiny_ckpt), str(out))
    return out


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_fp8_ckpt"])
def test_convert_dry_run_estimates_time_and_space(fixture: str, request: pytest.FixtureRequest,
                                                  tmp_path: Path) -> None:
    src = request.getfixturevalue(fixture)
    s = _json("convert", str(src), str(tmp_path / "a" / "out"), "--dry-run")
    rate = 0.1e9 if fixture == "tiny_fp8_ckpt" else 0.3e9  # FP8 dequantises: the slower stated rate
    assert s["throughput_bytes_per_s"] == rate and s["estimate_s"] == round(s["bytes_in"] / rate, 1)
    assert s["space_needed_bytes"] == s["bytes_out"] + s["bytes_out"] // 100 + 2**20
    assert s["space_checked_at"] == str(tmp_path)  # tmp_path/a does not exist: its nearest existing ancestor
    assert abs(s["space_free_bytes"] - _free(tmp_path)) < 2**26 and s["fits"] is True
    assert list(tmp_path.iterdir()) == []


def test_export_dry_run_plans_what_the_export_writes(mc: Path, tmp_path: Path) -> None:
    plan = _json("export", str(mc), str(tmp_path / "hf"), "--dry-run")
    assert list(tmp_path.iterdir()) == []
    done = _json("export", str(mc), str(tmp_path / "hf"))
    assert (plan["hf_tensors"], plan["mcore_tensors"]) == (done["hf_tensors"], done["mcore_tensors"])
    assert plan["bytes_in"] == plan["bytes_out"] == 1_189_840  # BF16 round trip: tensor bytes unchanged
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == plan["bytes_out"]
    assert plan["throughput_bytes_per_s"] == 0.3e9 and plan["estimate_s"] == round(1_189_840 / 0.3e9, 1)


def test_export_dry_run_fp8_counts_codes_and_scales(mc: Path, tmp_path: Path) -> None:
    plan = _json("export", str(mc), str(tmp_path / "hf"), "--dry-run", "--fp8")
    done = _json("export", str(mc), str(tmp_path / "hf"), "--fp8")
    assert plan["fp8"] is True and plan["throughput_bytes_per_s"] == 0.1e9
    assert plan["bytes_out"] == done["bytes_out"] < plan["bytes_in"]


def test_dry_run_text_states_the_assumption(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setattr(space, "free_bytes", lambda path: 5 * 10**9)
    res = CliRunner().invoke(cli, ["convert", str(tiny_ckpt), str(tmp_path / "out"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-2:] == [
        "estimated time: ~0.0 s at an assumed 0.30 GB/s of input (below the slowest rate measured on the "
        "project's 2-core benchmark host, benchmarks/RESULTS.md)",
        f"space: needs 0.002 GB, 5.000 GB free at {tmp_path}: fits"]


def test_no_space_check_dry_run_says_it_does_not_fit(tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setattr(space, "free_bytes", lambda path: 1000)
    s = _json("convert", str(tiny_ckpt), str(tmp_path / "out"), "--dry-run", "--no-space-check")
    assert (s["fits"], s["space_free_bytes"]) == (False, 1000)


def test_a_filesystem_without_a_size_is_not_checked(tiny_ckpt: Path) -> None:
    """sysfs reports f_blocks 0: the free space is unknown, so nothing is refused for it (nor claimed to fit)."""
    s = _json("convert", str(tiny_ckpt), "/sys/glmconv-test-out", "--dry-run")
    assert (s["space_checked_at"], s["space_free_bytes"], s["fits"]) == ("/sys", None, None)
