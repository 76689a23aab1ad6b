"""Issue 25: a signal at any step of publishing gives one of two outcomes, never a mix: OUT published and the run
succeeds, or nothing published and the previous OUT intact. Every line `glmconv/io/output.py` runs while
publishing is a step: SIGTERM delivered to another thread there (as the kernel may), and SIGKILL there.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from glmconv import interrupt
from glmconv.interrupt import Interrupted
from glmconv.io import output
from glmconv.io.file_names import MANIFEST_NAME

OUTPUT_PY = output.__file__


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def staged(tmp_path: Path, old: bool) -> tuple[Path, output.Stage]:
    """OUT (published before when `old`) and a staging directory holding the new output."""
    real = tmp_path / "out"
    if old:
        real.mkdir()
        (real / MANIFEST_NAME).write_text('{"written_by": "glmconv", "v": "old"}')
        (real / "data").write_bytes(b"old")
    stage = output.open_stage(real)
    (stage.path / MANIFEST_NAME).write_text('{"written_by": "glmconv", "v": "new"}')
    (stage.path / "data").write_bytes(b"new")
    return real, stage


NEW = {MANIFEST_NAME: b'{"written_by": "glmconv", "v": "new"}', "data": b"new"}
OLD = {MANIFEST_NAME: b'{"written_by": "glmconv", "v": "old"}', "data": b"old"}


def at_line(k: int, act: Callable[[], None]) -> Callable[..., Any]:
    """A tracer that calls `act` at the k-th line glmconv/io/output.py runs (k < 0: only counts, in `seen`)."""
    seen = [0]

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != OUTPUT_PY:
            return None
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                act()
        return trace

    trace.seen = seen  # type: ignore[attr-defined]
    return trace


def steps(tmp_path: Path, old: bool) -> int:
    """How many lines of glmconv/io/output.py a publish runs."""
    (tmp_path / "count").mkdir()
    real, stage = staged(tmp_path / "count", old)
    tracer = at_line(-1, lambda: None)
    sys.settrace(tracer)
    try:
        output.publish(stage, real, real, force=True)
    finally:
        sys.settrace(None)
    return tracer.seen[0]  # type: ignore[attr-defined]


@pytest.fixture
def handled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many signals glmconv's handler has seen (so a test can wait for one before leaving `catching`)."""
    seen: list[int] = []
    real = interrupt._handler

    def counting(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        real(signum, frame)

    monkeypatch.setattr(interrupt, "_handler", counting)
    return seen


def deliver(thread: threading.Thread, handled: list[int]) -> None:
    """SIGTERM sent to `thread`, and waited for: the handler has run (in the main thread) when this returns."""
    before = len(handled)
    signal.pthread_kill(thread.ident, signal.SIGTERM)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while len(handled) == before and time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.fixture
def sleeper() -> Iterator[threading.Thread]:
    """A thread that lets the kernel hand it a signal (it blocks nothing), as reader and sync threads do."""
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    yield t
    stop.set()
    t.join()


@pytest.mark.parametrize("old", [False, True], ids=["new-out", "force-over-old-out"])
def test_sigterm_taken_by_another_thread_at_any_publish_step_is_too_late(old: bool, tmp_path: Path,
                                                                         sleeper: threading.Thread,
                                                                         handled: list[int]) -> None:
    n = steps(tmp_path, old)
    assert n > 20
    for k in range(1, n + 1):
        d = tmp_path / f"k{k}"
        d.mkdir()
        real, stage = staged(d, old)
        interrupted = False
        with interrupt.catching():
            sys.settrace(at_line(k, lambda: deliver(sleeper, handled)))
            try:
                output.publish(stage, real, real, force=True)
                deliver(sleeper, handled)  # published, before the command ends
            except Interrupted:
                interrupted = True
                output.discard(stage)  # what run_on_output does on any failure
            finally:
                sys.settrace(None)
        assert tree(real) == ((OLD if old else {}) if interrupted else NEW), f"step {k} of {n}"
        assert sorted(p.name for p in d.iterdir()) == (["out"] if real.exists() else []), f"step {k} of {n}"


@pytest.mark.parametrize("old", [False, True], ids=["new-out", "force-over-old-out"])
def test_sigkill_at_any_publish_step_leaves_the_new_or_the_old_out_and_nothing_of_the_run(old: bool,
                                                                                         tmp_path: Path) -> None:
    """OUT right after the kill is exactly the new or the old one; absent only between the two renames, when
    the next run's recovery puts the old one back; the next run clears every leftover beside it."""
    n = steps(tmp_path, old)
    for k in range(1, n + 1):
        d = tmp_path / f"k{k}"
        d.mkdir()
        real, stage = staged(d, old)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child dies at step k
            sys.settrace(at_line(k, lambda: os.kill(os.getpid(), signal.SIGKILL)))
            output.publish(stage, real, real, force=True)
            sys.settrace(None)
            os._exit(0)
        stage.close()
        os.waitpid(pid, 0)
        if real.exists():
            assert tree(real) in (NEW, OLD) if old else tree(real) == NEW, k
        output.recover(real)  # what the next run does first, under the lock
        output.remove_ours(output.sibling(real, output.STAGING_SUFFIX), "staging")
        assert tree(real) in ((NEW, OLD) if old else (NEW, {})), k
        assert sorted(p.name for p in d.iterdir()) == (["out"] if real.exists() else []), k
