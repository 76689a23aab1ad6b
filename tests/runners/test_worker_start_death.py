"""Issue 39 (1): a `--workers` rank that dies while it starts, or a parent that dies while its workers start.

multiprocessing wrote a worker's start-up data (~100-300 kB of pickle: fn and the run's arguments) into a pipe
once the worker ran, holding the read end itself: a worker killed before it had read it all left the parent
blocked in that write forever (5 of 9 runs of `export --workers 2`), and a parent killed in it left the worker
an `UnpicklingError: pickle data was truncated` traceback. glmconv's workers now get their start-up data in a file
written in full before they start (glmconv/runners/ranks.py, `_WorkerPopen`), and bind themselves to the parent
before reading it.

The deaths are planted, not timed: a `sitecustomize` on the workers' PYTHONPATH makes the Nth worker to start
SIGKILL itself (or its parent) at a named point of its start: before it reads its start-up data, midway
through it (part of the pickled process object read), right after (before any glmconv code runs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import glmconv
from glmconv.errors import GlmconvError
from glmconv.runners import ranks

POINTS = ["before-reading", "midway", "after-reading"]
TIMEOUT_S = 60  # a hang is a failure, long before pytest's own limits

HOOK = '''\
"""Test hook (tests/runners/test_worker_start_death.py): the Nth multiprocessing worker to start acts at a point."""
import os
import sys


def _arm():
    spec = os.environ.get("GLMCONV_TEST_START_HOOK")  # POINT:ACTION:NTH:DIR
    if not spec or "--multiprocessing-fork" not in sys.argv:
        return
    point, action, nth, where = spec.split(":", 3)
    i = 0
    while True:  # this worker's place in the order of arrival
        try:
            fd = os.open(os.path.join(where, "arrived-%d" % i), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            i += 1
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        break
    if i != int(nth):
        return
    import signal

    def act():
        os.kill(os.getppid() if action == "kill-parent" else os.getpid(), signal.SIGKILL)

    if point == "before-reading":
        act()
    elif point == "midway":
        import pickle

        load, calls = pickle.load, []

        def load_then_act(file, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the process object, after the preparation data
                if action == "die":
                    file.read(4096)
                act()
            return load(file, *args, **kwargs)

        pickle.load = load_then_act
    elif point == "after-reading":
        from multiprocessing import process

        boot = process.BaseProcess._bootstrap

        def act_then_boot(self, *args, **kwargs):
            act()
            return boot(self, *args, **kwargs)

        process.BaseProcess._bootstrap = act_then_boot


_arm()
'''


@pytest.fixture(scope="module")
def hook_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("start-hook")
    (where / "sitecustomize.py").write_text(HOOK)
    return where


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    mc = tmp_path_factory.mktemp("start") / "mc"
    glmconv.convert(tiny_ckpt, mc)
    return mc


def _env(hook_dir: Path, spec: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), env.get("PYTHONPATH", "")) if p)
    env["GLMCONV_TEST_START_HOOK"] = spec
    return env


def _arrivals(where: Path) -> list[int]:
    return [int((where / f"arrived-{i}").read_text()) for i in range(len(list(where.glob("arrived-*"))))]


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(name))


def _cli(command: str, tiny: Path, mc: Path, out: Path) -> list[str]:
    args = {"convert": ["convert", str(tiny), str(out)],
            "export": ["export", str(mc), str(out), "--max-shard-size", "100KB"],  # files for 2 workers (issue 38)
            "verify": ["verify", str(tiny), str(mc)]}[command]
    return [sys.executable, "-m", "glmconv", *args, "--workers", "2"]


# ---- a worker killed while it starts: the run ends at once, exit 2, one line naming the rank --------------

def _dies(command: str, point: str, nth: int, tiny: Path, mc: Path, hook: Path, case: Path) -> None:
    """The `nth` worker to start killed at `point`: exit 2, `error: a COMMAND worker died (rank R killed by
    SIGKILL); nothing published` and nothing else, no staging directory, no lock, within seconds."""
    (case / "arrived").mkdir(parents=True)
    start = time.monotonic()
    proc = subprocess.run(_cli(command, tiny, mc, case / "out"), capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=_env(hook, f"{point}:die:{nth}:{case / 'arrived'}"))
    took = time.monotonic() - start
    what = f"{command}, worker {nth} killed {point}: {proc.stderr!r}"
    assert proc.returncode == 2, what
    assert re.fullmatch(rf"error: a {command} worker died \(rank [01] killed by SIGKILL\); nothing published\n",
                        proc.stderr), what
    assert _leftovers(case, "out") == [], what
    assert took < TIMEOUT_S / 2, what


@pytest.mark.parametrize("point", POINTS)
def test_a_convert_worker_killed_while_it_starts_ends_the_run(point: str, tiny_ckpt: Path, converted: Path,
                                                             hook_dir: Path, tmp_path: Path) -> None:
    """The first and the second worker to start, at each point (convert: the cheapest command to start)."""
    for nth in (0, 1):
        _dies("convert", point, nth, tiny_ckpt, converted, hook_dir, tmp_path / f"{nth}")


@pytest.mark.parametrize("command", ["export", "verify"])
def test_an_export_or_verify_worker_killed_before_it_reads_ends_the_run(command: str, tiny_ckpt: Path,
                                                                       converted: Path, hook_dir: Path,
                                                                       tmp_path: Path) -> None:
    """The measured hang: the second worker killed as it appears, its start-up data unread."""
    _dies(command, "before-reading", 1, tiny_ckpt, converted, hook_dir, tmp_path / "case")


# ---- the same, many times over: spawn in this process, the cheapest launch ----------------------------------

def _padded_outcome(padding: bytes, rank: int, world: int, group: object) -> dict[str, int]:
    return {"rank": rank}


@contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """A hang here fails the test (SIGALRM interrupts even a blocked write) instead of stalling the suite."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still launching after {seconds} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture
def hooked(hook_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers spawned by this process start with the hook."""
    monkeypatch.setenv("PYTHONPATH", _env(hook_dir, "")["PYTHONPATH"])


@pytest.mark.parametrize("point", POINTS)
def test_a_worker_killed_while_it_starts_never_hangs_the_launch(point: str, hooked: None, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    """16 launches of 2 workers per point (the first or the second to start killed; the payload is padded past
    what a pipe holds): each ends with the dead rank named, never hangs, and no worker prints anything."""
    padding = os.urandom(256 * 1024)  # more than a pipe holds: multiprocessing's write of it would block
    for run in range(16):
        arrived = tmp_path / f"{run}"
        arrived.mkdir()
        monkeypatch.setenv("GLMCONV_TEST_START_HOOK", f"{point}:die:{run % 2}:{arrived}")
        with _deadline(TIMEOUT_S // 2), pytest.raises(GlmconvError, match=r"^a test worker died \(rank [01] killed "
                                                                          r"by SIGKILL\); nothing published$"):
            ranks.spawn(_padded_outcome, (padding,), 2, "test")
    out, err = capfd.readouterr()
    assert err == "" and out == "", err


# ---- the parent killed while its workers start: they end, silently --------------------------------------

@pytest.mark.parametrize("point", POINTS)
def test_a_parent_killed_while_its_workers_start_leaves_nothing_behind(point: str, tiny_ckpt: Path,
                                                                       converted: Path, hook_dir: Path,
                                                                       tmp_path: Path) -> None:
    """The first worker to start SIGKILLs the parent (blocked, before the fix, writing the second's start-up
    data): every worker ends within seconds and none prints anything (no truncated-pickle traceback)."""
    for nth in (0, 1):
        case = tmp_path / f"{nth}"
        (case / "arrived").mkdir(parents=True)
        cmd = _cli("convert", tiny_ckpt, converted, case / "out")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(hook_dir, f"{point}:kill-parent:{nth}:{case / 'arrived'}"))
        out, err = proc.communicate(timeout=TIMEOUT_S)  # EOF only once every worker holding stderr has ended
        assert proc.returncode == -signal.SIGKILL, err
        assert err == "" and out == "", err
        for pid in _arrivals(case / "arrived"):
            assert _ends(pid, within=10), f"worker {pid} outlived its parent"


def _ends(pid: int, within: float) -> bool:
    """`pid` has ended (or is a zombie) within `within` s: stderr closed, it may still be a moment from exit."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False
