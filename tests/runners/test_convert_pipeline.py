"""Issue 14: reading and FP8 dequantisation run ahead of the writer on threads, data files are fsynced as each
is finished, and none of it changes a byte of the output: every file of a threaded run equals the serial run's.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from glmconv.ahead import Step, run_ahead
from glmconv.errors import CheckpointError
from glmconv.runners.convert import RunOptions, convert, prepare

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
METADATA = "release/.metadata"
SMALL = {"group_bytes": 64 << 10, "chunk_bytes": 8 << 10}  # many data files and row steps at toy sizes


def digests(root: Path) -> dict[str, object]:
    """sha256 of every file under `root` (data files, sidecars, manifest), by relative path; for DCP's
    `.metadata`, what it says of the tensors (it also holds a random save id and the staging path)."""
    out: dict[str, object] = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                              for p in sorted(root.rglob("*")) if p.is_file()}
    metadata = pickle.loads((root / METADATA).read_bytes())
    out[METADATA] = (metadata.state_dict_metadata, metadata.storage_data)
    return out


def converted(src: Path, out: Path, **opts: Any) -> dict[str, object]:
    convert(prepare(src, out), RunOptions(progress=False, **opts))
    return digests(out)


# ---- the output ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_fp8_ckpt", "cut8_ckpt"])
def test_threads_ahead_of_the_writer_give_the_serial_paths_files_byte_for_byte(
        fixture: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serial: one step at a time, the reference dequantisation; ahead: 3 readers, FP8 in 128-row slabs on 3 threads."""
    import glmconv.numerics.dequant as dequant

    src = request.getfixturevalue(fixture)
    serial = converted(src, tmp_path / "serial", threads=0, fp8_threads=1, device="cpu", **SMALL)
    monkeypatch.setattr(dequant, "SLAB_ROWS", 128)  # the tiny FP8 weights of more than 128 rows are cut too
    ahead = converted(src, tmp_path / "ahead", threads=3, ahead_bytes=32 << 10, fp8_threads=3, **SMALL)
    assert sum(name.endswith(".distcp") for name in serial) > 3  # several groups: order across files matters
    assert ahead == serial


def test_stacked_experts_are_dequantised_in_place_with_the_transforms_bytes(
        tiny_fp8_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each expert (and each part of a dim-0 concatenation) is dequantised straight into its rows of the output,
    never stacked after: the files equal those the transform's own forward makes."""
    import glmconv.runners.convert as convert_mod
    from glmconv.rules.ops import Concat, StackExperts

    stacked = []
    forward = StackExperts.forward
    monkeypatch.setattr(StackExperts, "forward", lambda self, hf, n: stacked.append(len(hf)) or forward(self, hf, n))
    monkeypatch.setattr(convert_mod, "_whole_inputs", lambda pieces, sizes: False)  # every mapping by forward
    by_forward = converted(tiny_fp8_ckpt, tmp_path / "forward", **SMALL)
    monkeypatch.undo()
    assert len(stacked) > 1  # FP8 experts, several row steps

    def refused(self: object, hf: object, n_mcore: int) -> None:
        raise AssertionError("stacked after dequantisation: a copy of every byte more")
    monkeypatch.setattr(StackExperts, "forward", refused)
    monkeypatch.setattr(Concat, "forward", refused)
    assert converted(tiny_fp8_ckpt, tmp_path / "in-place", **SMALL) == by_forward


# ---- run_ahead -------------------------------------------------------------------------------------------

def slow_step(i: int, nbytes: int, held: list[int], peak: list[int], lock: threading.Lock) -> Step:
    """Step `i`: adds its bytes to `held` while it runs and until its chunk is consumed."""
    def make() -> list[int]:
        with lock:
            held[0] += nbytes
            peak[0] = max(peak[0], held[0])
        time.sleep(0.002 * (i % 3))  # later steps finish first now and then: order must not follow completion
        return [i]
    return Step(nbytes, make)


def test_chunks_come_out_in_step_order_and_in_flight_bytes_stay_under_the_bound() -> None:
    held, peak, lock = [0], [0], threading.Lock()
    steps = [slow_step(i, 100, held, peak, lock) for i in range(40)]
    got = []
    for chunk in run_ahead(steps, threads=4, ahead_bytes=300):
        got.append(chunk)
        with lock:
            held[0] -= 100
    assert got == list(range(40))
    assert peak[0] <= 300 + 100  # the bound, plus the one chunk the consumer holds


def test_a_step_larger_than_the_bound_runs_alone() -> None:
    held, peak, lock = [0], [0], threading.Lock()
    steps = [slow_step(i, n, held, peak, lock) for i, n in enumerate([10, 1000, 10, 10])]
    got = []
    for chunk in run_ahead(steps, threads=4, ahead_bytes=100):
        got.append(chunk)
        with lock:
            held[0] -= [10, 1000, 10, 10][chunk]
    assert got == [0, 1, 2, 3]
    assert peak[0] <= 1000 + 10


def test_a_failing_step_raises_where_the_serial_path_would() -> None:
    def boom() -> list[int]:
        raise CheckpointError("step 2: bad block scale")

    steps = [Step(1, lambda: [0]), Step(1, lambda: [1]), Step(1, boom), Step(1, lambda: [3])]
    got: list[int] = []
    with pytest.raises(CheckpointError, match="^step 2: bad block scale$"):
        for chunk in run_ahead(steps, threads=2, ahead_bytes=10):
            got.append(chunk)
    assert got == [0, 1]


def test_steps_that_cannot_be_listed_fail_after_the_chunks_before_them() -> None:
    def steps() -> Iterator[Step]:
        yield Step(1, lambda: (time.sleep(0.05), [0])[1])
        raise CheckpointError("w: not in the checkpoint")

    got: list[int] = []
    with pytest.raises(CheckpointError, match="^w: not in the checkpoint$"):
        for chunk in run_ahead(steps(), threads=2):
            got.append(chunk)
    assert got == [0]


def test_zero_threads_makes_each_step_when_it_is_reached() -> None:
    made: list[int] = []
    steps = [Step(1, lambda i=i: made.append(i) or [i]) for i in range(3)]
    seen = [(chunk, list(made)) for chunk in run_ahead(steps, threads=0)]
    assert seen == [(0, [0]), (1, [0, 1]), (2, [0, 1, 2])]


# ---- fsync -----------------------------------------------------------------------------------------------

def test_every_data_file_is_fsynced_before_any_metadata_is_written(
        tiny_fp8_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.io.background_sync as bs
    import glmconv.io.torch_dist.writer as dw

    synced: list[str] = []
    fsync_path = bs.fsync_path
    monkeypatch.setattr(bs, "fsync_path", lambda path: (fsync_path(path), synced.append(path.name)))
    publish = dw.DcpWriter._publish
    at_publish: list[list[str]] = []
    monkeypatch.setattr(dw.DcpWriter, "_publish", lambda self, parts: (at_publish.append(sorted(synced)),
                                                                         publish(self, parts))[1])
    files = converted(tiny_fp8_ckpt, tmp_path / "out", group_bytes=64 << 10)
    data = sorted(name.split("/")[-1] for name in files if name.endswith(".distcp"))
    assert len(data) > 3
    assert at_publish == [data]  # each one once, all of them before `.metadata` (the common state's file too)


# ---- worker counts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("workers", ["auto", 1, 3, "7"])
def test_auto_is_one_worker_and_a_count_is_that_count(workers: int | str) -> None:
    from glmconv.runners.workers import worker_count

    assert worker_count(workers) == {"auto": 1, 1: 1, 3: 3, "7": 7}[workers]


def test_one_two_and_auto_workers_write_the_same_tensors(tiny_fp8_ckpt: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import mcore_helpers as mh

    import glmconv.runners.workers as workers
    from glmconv import api

    monkeypatch.setattr(workers, "AUTO_WORKERS", 3)  # the rule's count, whatever it is, goes through
    counts = {}
    for n in (1, 2, "auto"):
        counts[n] = len(api.convert(tiny_fp8_ckpt, tmp_path / str(n), workers=n)["workers"])
    cores = len(os.sched_getaffinity(0))  # never more workers than cores (issue 38)
    assert counts == {1: 1, 2: min(2, cores), "auto": min(3, cores)}
    one = mh.read_dcp(tmp_path / "1")
    for n in ("2", "auto"):
        other = mh.read_dcp(tmp_path / n)
        assert sorted(other) == sorted(one)
        for name, t in one.items():
            mh.assert_same(name, other[name], t)


@pytest.mark.parametrize("value", ["x", "0", "257", "-1"])
def test_workers_neither_a_count_nor_auto_is_a_usage_error(value: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from glmconv_cli.main import cli

    res = CliRunner().invoke(cli, ["convert", str(tiny_ckpt), str(tmp_path / "out"), "--workers", value])
    assert (res.exit_code, res.stderr) == (2, f"error: Invalid value for '--workers': {value}: expected a count "
                                              f"from 1 to 256, or auto\n")
    assert list(tmp_path.iterdir()) == []
