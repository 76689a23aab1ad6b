"""Issue 25: every file and directory glmconv writes gets the same permission bits (0644 / 0755 under the
umask), whichever command wrote it: no shard is left private (0600) while its index is world-readable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glmconv import api
from glmconv.fixtures import make_fixture

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def modes(root: Path) -> set[tuple[str, str]]:
    """(kind, octal mode) of everything under `root`."""
    return {("dir" if p.is_dir() else "file", oct(p.stat().st_mode & 0o777)) for p in root.rglob("*")} | {
        ("dir", oct(root.stat().st_mode & 0o777))}


def expected() -> set[tuple[str, str]]:
    umask = os.umask(0)
    os.umask(umask)
    return {("file", oct(0o644 & ~umask)), ("dir", oct(0o755 & ~umask))}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fixture_make_writes_shards_with_the_mode_of_every_other_file(fp8: bool, tmp_path: Path) -> None:
    out = make_fixture(tmp_path / "hf", "tiny", fp8=fp8, seed=0)
    assert modes(out) <= expected()


def test_convert_export_and_relayout_write_every_file_with_one_mode(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    api.convert(tiny_fp8_ckpt, tmp_path / "mc")
    api.export(tmp_path / "mc", tmp_path / "hf", fp8=True)
    api.relayout(tmp_path / "mc", tmp_path / "native", to="mcore")
    for out in ("mc", "hf", "native"):
        assert modes(tmp_path / out) <= expected(), out
