"""Re-runs are byte-identical (issue 39, item 7): the same input gives the same tree, file by file, wherever it goes.

DCP's `FileSystemWriter` records a random uuid4 (`save_id`) and the directory it saved to (`checkpoint_id`) in
`.metadata`; glmconv's writer records a uuid derived from the metadata and the directory relative to the
checkpoint root (`release`, `release/glmconv_kept`), so 20 runs into 20 output directories give one sha256 per
file, for both layouts (the mcore one has a second `.metadata`, the kept-tensor sidecar's) and for relayout. No
file holds the output path or the staging path (deleted once published). Runs go through the Python API in this
process: a run of the tiny fixture is a fraction of a second.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from glmconv import api
from glmconv.io.file_names import DCP_METADATA_NAME, KEPT_DIR, RELEASE

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

RUNS = 20


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by path relative to it."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_identical(outs: list[Path]) -> dict[str, str]:
    first = tree(outs[0])
    for out in outs[1:]:
        got = tree(out)
        assert sorted(got) == sorted(first), f"{out}: other files than {outs[0]}"
        differ = [name for name in first if got[name] != first[name]]
        assert not differ, f"{out}: {differ} differ from {outs[0]}"
    for out in outs:  # neither where it was written nor where it was staged
        for p in out.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                assert str(out).encode() not in data and b".glmconv-staging" not in data, p
    return first


def _storage_meta(ckpt_dir: Path) -> tuple[object, str]:
    md = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    return md.storage_meta.checkpoint_id, md.storage_meta.save_id


@pytest.mark.parametrize("layout", ["miles", "mcore"])
def test_convert_reruns_are_byte_identical(layout: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    outs = [tmp_path / f"run{i}" / "mc" for i in range(RUNS)]  # also at different depths: the path is nowhere
    outs[1] = tmp_path / "elsewhere" / "deeper" / "mc"
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        api.convert(tiny_ckpt, out, layout=layout)
    files = _assert_identical(outs)
    assert f"{RELEASE}/{DCP_METADATA_NAME}" in files
    assert (f"{RELEASE}/{KEPT_DIR}/{DCP_METADATA_NAME}" in files) == (layout == "mcore")
    checkpoint_id, save_id = _storage_meta(outs[0] / RELEASE)
    assert checkpoint_id == RELEASE
    if layout == "mcore":
        kept_id, kept_save_id = _storage_meta(outs[0] / RELEASE / KEPT_DIR)
        assert kept_id == f"{RELEASE}/{KEPT_DIR}" and kept_save_id != save_id  # another content, another id


@pytest.fixture(scope="module")
def tiny_miles(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rerun") / "mc"
    api.convert(tiny_ckpt, out, layout="miles")
    return out


def test_relayout_reruns_are_byte_identical(tiny_miles: Path, tmp_path: Path) -> None:
    outs = [tmp_path / f"run{i}" for i in range(RUNS)]
    for out in outs:
        api.relayout(tiny_miles, out, to="mcore")
    files = _assert_identical(outs)
    assert f"{RELEASE}/{KEPT_DIR}/{DCP_METADATA_NAME}" in files

