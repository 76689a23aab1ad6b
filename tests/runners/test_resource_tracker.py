"""Issue 25 (#10): multiprocessing's resource tracker killed during `--workers 2` never reaches the user.

The launching process talks to its workers over plain pipes and registers nothing with the tracker, so a
tracker killed at any phase (while the workers start, while they run) and relaunched has nothing to
unregister: no KeyError traceback, no "might leak" warning; the run completes (exit 0) or, failing, publishes
nothing (exit 2).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import glmconv
from glmconv.runners import ranks

PHASES = ["while-the-workers-start", "while-the-workers-run"]


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    mc = tmp_path_factory.mktemp("tracker") / "mc"
    glmconv.convert(tiny_ckpt, mc)
    return mc


def _tracker_and_workers(pid: int) -> tuple[psutil.Process | None, int]:
    tracker, workers = None, 0
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in cmd:
            tracker = child
        elif "multiprocessing.spawn" in cmd:
            workers += 1
    return tracker, workers


def _kill_tracker(proc: subprocess.Popen[str], phase: str) -> bool:
    """SIGKILL the resource tracker at `phase`: at first sight, or once both workers are up and working."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            tracker, workers = _tracker_and_workers(proc.pid)
        except psutil.Error:
            return False
        if tracker is not None and (phase == "while-the-workers-start" or workers == 2):
            if phase == "while-the-workers-run":
                time.sleep(0.3)
            tracker.send_signal(signal.SIGKILL)
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("phase", PHASES)
def test_killing_the_resource_tracker_prints_no_traceback(converted: Path, tmp_path: Path, phase: str) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "glmconv", "export", str(converted), str(out), "--workers", "2", "--max-shard-size",
           "100KB"]  # files enough for two workers (one file is one worker's: issue 38)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _kill_tracker(proc, phase)
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "resource_tracker" not in err, err
    assert proc.returncode in (0, 2), err
    assert out.exists() == (proc.returncode == 0)


def _outcome(rank: int, world: int, group: Any) -> dict[str, Any]:
    return {"rank": rank}


def test_workers_are_run_without_anything_the_tracker_must_forget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The class: no semaphore (or other resource) of the run is registered with the tracker by this process."""
    from multiprocessing import resource_tracker

    registered: list[tuple[str, str]] = []
    monkeypatch.setattr(resource_tracker, "register", lambda name, rtype: registered.append((name, rtype)))
    assert ranks.spawn(_outcome, (), 2, "test")["rank"] in (0, 1)
    assert registered == []
