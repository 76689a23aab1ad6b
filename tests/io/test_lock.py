"""Two runs on one output directory never interleave: the second fails at once, naming the first's pid.

The lock is `fcntl.flock` on `OUT.glmconv-lock` (glmconv/lock.py), taken by the launching process of convert
and export (glmconv/runners/ranks.py `run_on_output`) for the whole run and removed at its end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from glmconv.errors import GlmconvError
from glmconv.lock import OutputLock, OutputLockedError, lock_path
from glmconv.runners import convert as convert_mod
from glmconv.runners import ranks as runner
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ROOT = Path(__file__).resolve().parents[2]

# Holds OUT's lock from another process until killed.
HOLDER = """
import sys, time
from glmconv.lock import OutputLock
lock = OutputLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
time.sleep(120)
"""

# `glmconv ARGS`, with every source tensor read held back until the file GATE exists: a run that is
# certainly still in progress (lock taken, staging begun) for as long as the test wants.
GATED = """
import os, sys, time
import glmconv.io.safetensors.reader as hf_reader
gate = sys.argv.pop(1)
entry = hf_reader.HfTensorSource.entry  # every tensor read or copied is located first
def gated(self, *a, **k):
    deadline = time.monotonic() + 120
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return entry(self, *a, **k)
hf_reader.HfTensorSource.entry = gated
from glmconv_cli.main import main
sys.argv[0] = "glmconv"
main()
"""


def _wait_for(cond, what: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"process ended (rc {proc.returncode}) before {what}: {err.decode()[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _expected(out: Path, pid: int) -> str:
    return (f"error: {out} is being written by another glmconv process (pid {pid}); wait for it or remove "
            f"{lock_path(out)} if that process is gone")


@pytest.fixture
def holder(tmp_path: Path):
    """Start a process that holds the lock of `out`; yields a starter, kills what it started."""
    procs: list[subprocess.Popen] = []

    def start(out: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, cwd=ROOT)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == b"locked"
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("command", ["convert", "export"])
def test_second_run_fails_at_once_while_another_process_holds_the_lock(command: str, holder, tiny_ckpt: Path,
                                                                       tmp_path: Path) -> None:
    src = tiny_ckpt
    if command == "export":
        src = tmp_path / "mc"
        convert_mod.convert(convert_mod.prepare(tiny_ckpt, src), convert_mod.RunOptions(progress=False))
    out = tmp_path / "out"
    proc = holder(out)
    start = time.monotonic()
    res = CliRunner().invoke(cli, [command, str(src), str(out)])
    assert time.monotonic() - start < 30, "the second run must fail at once, not wait for the lock"
    assert res.exit_code == 2 and res.stderr == _expected(out, proc.pid) + "\n", res.stderr
    assert not out.exists() and not runner.staging_dir(out).exists()
    assert lock_path(out).read_text().strip() == str(proc.pid), "the refused run must leave the holder's lock alone"
    proc.send_signal(signal.SIGKILL)  # the kernel drops a dead process's flock; its lock file stays behind
    proc.wait()
    assert lock_path(out).exists()
    res = CliRunner().invoke(cli, [command, str(src), str(out), "--json"])
    assert res.exit_code == 0, res.stderr
    assert not lock_path(out).exists() and not runner.staging_dir(out).exists()


def test_second_convert_while_the_first_is_running(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Two real `glmconv convert` processes on one OUT: the second is refused, the first completes."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    first = subprocess.Popen([sys.executable, "-c", GATED, str(gate), "convert", str(tiny_ckpt), str(out), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        _wait_for(lambda: runner.staging_dir(out).is_dir() and lock_path(out).is_file()
                  and lock_path(out).read_text().strip() == str(first.pid), "the first run to take the lock", first)
        second = subprocess.run([sys.executable, "-m", "glmconv", "convert", str(tiny_ckpt), str(out)],
                                capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [_expected(out, first.pid)], second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None and runner.staging_dir(out).is_dir(), "the refused run touched the first's work"
        gate.touch()
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err.decode()
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert not lock_path(out).exists(), "the lock file is removed when the run ends"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate", "out"]


def test_lock_is_removed_when_the_run_fails(tiny_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.io.safetensors.reader as hf_reader

    def broken(self, name):
        raise GlmconvError(f"{name}: simulated read failure")

    monkeypatch.setattr(hf_reader.HfTensorSource, "entry", broken)
    res = CliRunner().invoke(cli, ["convert", str(tiny_ckpt), str(tmp_path / "out")])
    assert res.exit_code == 2 and "simulated read failure" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_lock_in_one_process_refuses_a_second_holder_and_names_the_pid(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with OutputLock(out) as lock:
        assert lock.held and lock_path(out).read_text() == f"{os.getpid()}\n"
        with pytest.raises(OutputLockedError) as err:
            OutputLock(out).acquire()  # flock is per open file: a second open in the same process conflicts too
        assert str(err.value) == _expected(out, os.getpid()).removeprefix("error: ")
    assert not lock_path(out).exists()


def test_stale_lock_file_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    out = tmp_path / "out"
    lock_path(out).write_text("999999999\n")
    with OutputLock(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert not lock_path(out).exists()


def test_lock_needs_a_writable_parent(tmp_path: Path) -> None:
    with pytest.raises(GlmconvError, match="output parent directory does not exist"):
        OutputLock(tmp_path / "missing" / "out").acquire()


def test_only_the_launching_process_or_rank_0_takes_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    seen = []

    def fake_run_ranks(fn, args, workers, what, stage=None):
        seen.append(lock_path(out).exists())
        return {}

    monkeypatch.setattr(runner, "run_ranks", fake_run_ranks)
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        runner.run_on_output(out, {}, False, lambda *a: {}, (), 1, "test")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    runner.run_on_output(out, {}, False, lambda *a: {}, (), 2, "test")
    assert seen == [True, False, True]
    assert not lock_path(out).exists()
