"""Issue 38: every run says where its time went (`phases` in the summary), each phase once, none negative."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import glmconv
from glmconv import phases

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
WRITERS = {"plan", "read", "write", "flush", "verify", "fsync", "publish"}  # convert and export


def _ok(got: dict[str, float], want: set[str]) -> None:
    assert want <= set(got), sorted(want - set(got))
    assert all(v >= 0 for v in got.values()), got


def test_convert_export_and_verify_report_their_phases(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    converted = glmconv.convert(tiny_fp8_ckpt, tmp_path / "mc")
    _ok(converted["phases"], WRITERS)
    began = time.monotonic()
    exported = glmconv.export(tmp_path / "mc", tmp_path / "hf", fp8=True, like=tiny_fp8_ckpt)
    wall = time.monotonic() - began
    _ok(exported["phases"], WRITERS)
    assert exported["phases"]["plan"] < wall  # its plan (before and in the run) timed once: part of the call
    verified = glmconv.verify(tiny_fp8_ckpt, tmp_path / "mc")
    _ok(verified["phases"], {"plan", "compare"})


def test_an_fp8_export_says_what_its_threads_were_busy_with(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    glmconv.convert(tiny_fp8_ckpt, tmp_path / "mc")
    exported = glmconv.export(tmp_path / "mc", tmp_path / "hf", fp8=True, like=tiny_fp8_ckpt)
    assert set(exported["busy"]) == {"load", "like", "encode", "scan"}  # BF16 tensors are copied and scanned
    assert all(v > 0 for v in exported["busy"].values()), exported["busy"]
    assert phases.take_busy() == {}  # drained into the summary


def test_a_run_reports_only_its_own_time() -> None:
    phases.begin()  # this process's first run (its `startup`, once), whichever test ran before on this worker
    phases.add("read", 5.0)  # what a run that failed before left behind
    phases.begin()
    with phases.timed("write"):
        pass
    assert list(phases.take()) == ["write"] and phases.take() == {}
    assert list(phases.timed_iter(iter([1, 2]), "read")) == [1, 2] and set(phases.take()) == {"read"}
    assert phases.merged({"read": 1.0}, {"read": 0.5, "publish": 0.25}, None) == {"read": 1.5, "publish": 0.25}
