"""Issue 38: torchrun across two nodes (two launchers on this machine, rendezvous on 127.0.0.1) for convert,
export and verify: every tensor bit for bit, and the export the very files of one process and of --workers N."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import mcore_helpers as mh

import glmconv
from glmconv.defaults import WORKER_MIN_BYTES_ENV
from glmconv.runners import ranks
from glmconv.runners.workers import capped

ROOT = Path(__file__).resolve().parents[2]
SHARD = "100KB"  # the tiny fixture's export cut into a dozen files: work for both nodes
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def two_nodes(*args: str) -> list[subprocess.CompletedProcess[str]]:
    """`glmconv ARGS` under two torchrun launchers (`--nnodes 2`, one rank each), as on two machines sharing a
    filesystem; each launcher's outcome, node 0 first."""
    port = str(mh.free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                               "-m", "glmconv", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT)
             for node in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def ok(runs: list[subprocess.CompletedProcess[str]]) -> dict:
    """Node 0's summary, once both nodes succeeded and node 1 printed nothing on stdout (one report, rank 0's)."""
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert runs[1].stdout == ""
    return json.loads(runs[0].stdout)


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def converted(tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nodes") / "mc"
    summary = ok(two_nodes("convert", str(tiny_fp8_ckpt), str(out), "--json"))
    assert summary["published"] == str(out)
    return out


def test_two_nodes_convert_every_tensor_bit_for_bit(tiny_fp8_ckpt: Path, converted: Path) -> None:
    ranks_seen = {p.name.split("_")[2] for p in (converted / "release").glob("__*_*.distcp")}
    assert ranks_seen == {"0", "1"}  # each node's rank wrote its own data files
    want, got = mh.reference_mcore(tiny_fp8_ckpt), mh.read_dcp(converted)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        mh.assert_same(name, got[name], t)


def test_two_nodes_verify_every_tensor(tiny_fp8_ckpt: Path, converted: Path) -> None:
    summary = ok(two_nodes("verify", str(tiny_fp8_ckpt), str(converted), "--json"))
    assert summary["equal"] and summary["mismatches"] == 0


def test_two_nodes_export_the_files_of_one_process_and_of_any_workers(converted: Path, tmp_path: Path) -> None:
    summary = ok(two_nodes("export", str(converted), str(tmp_path / "nodes"), "--max-shard-size", SHARD, "--json"))
    assert summary["workers"] == 2 and summary["shards"] > 2
    want = files(tmp_path / "nodes")
    for workers in (1, 2, 4):
        out = tmp_path / f"w{workers}"
        run = subprocess.run([sys.executable, "-m", "glmconv", "export", str(converted), str(out), "--max-shard-size",
                              SHARD, "--workers", str(workers), "--json"], capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        assert files(out) == want, f"--workers {workers}"
        why = json.loads(run.stdout)["workers_capped"]
        assert (why or "") in run.stderr  # the cap's reason on stderr too
        if workers > len(os.sched_getaffinity(0)):
            assert why and why.startswith(f"--workers {workers} capped to ")


def test_two_nodes_export_fp8_like_gives_the_release_back(tiny_fp8_ckpt: Path, converted: Path,
                                                          tmp_path: Path) -> None:
    ok(two_nodes("export", str(converted), str(tmp_path / "hf"), "--fp8", "--like", str(tiny_fp8_ckpt), "--json"))
    got, src = files(tmp_path / "hf"), files(tiny_fp8_ckpt)
    tensors = [n for n in src if n.endswith(".safetensors") or n.endswith(".index.json")]
    assert tensors and {n: got.get(n) for n in tensors} == {n: src[n] for n in tensors}


def test_each_node_gets_its_own_progress_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert ranks.rank_label("export", 2, 4) == "export [node 1, rank 2/4]" and ranks.progress_here(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not ranks.progress_here(3)


def test_a_worker_count_that_cannot_help_is_capped_and_says_why() -> None:
    big, small = 10**12, 11_300_000_000
    assert capped(4, big, 3, "group of output files", "groups of output files", cores=16) == (
        3, "--workers 4 capped to 3: the run has 3 groups of output files that a worker can take on its own")
    assert capped(8, big, 100, "mapping", "mappings", cores=2) == (
        2, "--workers 8 capped to 2: this process may run on 2 cores (more processes only contend for them)")
    assert capped(4, small, 100, "mapping", "mappings", cores=16, min_bytes=100 * 10**9) == (
        1, "--workers 4 capped to 1: the run reads 11.3 GB, less than 100 GB: one worker keeps the disk busy, and "
        "another's start (a Python, torch, a CUDA context) would cost more than it saves")
    assert capped(2, big, 100, "mapping", "mappings", cores=16) == (2, None)
    assert capped(1, small, 100, "mapping", "mappings", cores=16) == (1, None)


def test_a_small_run_gets_one_worker_and_says_so(converted: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_MIN_BYTES_ENV)  # the default: the tests' own setting lets tiny runs have N
    summary = glmconv.export(converted, tmp_path / "hf", workers=2)
    assert (summary["workers"], summary["workers_requested"]) == (1, 2)
    assert summary["workers_capped"].startswith("--workers 2 capped to 1: the run reads 0.00")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_export_on_a_gpu_that_is_not_there_is_refused_before_writing(converted: Path, tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "glmconv", "export", str(converted), str(tmp_path / "hf"), "--fp8",
                          "--device", "cuda"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and run.stderr.startswith("error: --device cuda: no CUDA device is visible")
    assert not (tmp_path / "hf").exists()
