"""convert and export under `torchrun --nproc-per-node 2`: each rank writes its own files, the result is the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mcore_helpers as mh

import glmconv

ROOT = Path(__file__).resolve().parents[2]


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(mh.free_port()),
           "-m", "glmconv", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.fixture(scope="module")
def converted_by_ranks(cut8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torchrun") / "mc"
    run = torchrun("convert", str(cut8_ckpt), str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_each_rank_writes_its_own_data_files(converted_by_ranks: Path) -> None:
    ranks = {p.name.split("_")[2] for p in (converted_by_ranks / "release").glob("__*_*.distcp")}
    assert ranks == {"0", "1"}
    assert (converted_by_ranks / "latest_checkpointed_iteration.txt").read_text() == "release"


def test_torchrun_convert_lands_every_tensor_bit_for_bit(cut8_ckpt: Path, converted_by_ranks: Path) -> None:
    want, got = mh.reference_mcore(cut8_ckpt), mh.read_dcp(converted_by_ranks)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        mh.assert_same(name, got[name], t)


def test_torchrun_export_round_trips_bit_for_bit(cut8_ckpt: Path, converted_by_ranks: Path, tmp_path: Path) -> None:
    run = torchrun("export", str(converted_by_ranks), str(tmp_path / "hf"))
    assert run.returncode == 0, run.stderr[-3000:]
    want, got = mh.read_safetensors(cut8_ckpt), mh.read_safetensors(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        mh.assert_same(name, got[name], t)
    glmconv.export(converted_by_ranks, tmp_path / "one")  # issue 38: the same files as one process, not one per rank
    assert _files(tmp_path / "hf") == _files(tmp_path / "one")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("command", ["convert", "export"])
def test_torchrun_json_is_one_document_from_rank_0(command: str, cut8_ckpt: Path, converted_by_ranks: Path,
                                                   tmp_path: Path) -> None:
    src = cut8_ckpt if command == "convert" else converted_by_ranks
    run = torchrun(command, str(src), str(tmp_path / "out"), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)  # two documents (one per rank) would not parse
    assert summary["published"] == str(tmp_path / "out")
    assert run.stdout.count('"published"') == 1
