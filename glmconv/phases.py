"""Where a run's time goes: named phases timed in this process, drained into every run's summary (`phases`).

Each process keeps its own sums (a worker's travel back in rank 0's summary, the launching process adds its own:
planning, the fsyncs and the publish), so the summary's figures add up along the run's critical path. Names:
startup (the interpreter and glmconv's own imports), plan, import (torch), worker_start (a --workers process: its
Python, torch and gloo group), cuda_init, read (the writer waiting for its input), write, flush, verify (verify:
compare), fsync, publish. Beside them, `busy`: what the threads ahead of the writer spent their time on, summed
over threads (export: load, the Megatron chunks read and checked; like, --like's codes; encode, FP8 on its device;
scan, the bytes copied file to file checked for NaN/Inf): where a long `read` wait comes from.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from glmconv import collector

T = TypeVar("T")

_TIMES: dict[str, float] = {}
_BUSY: dict[str, float] = {}  # seconds the reader/encoder threads spent, by step (`busy`)
_LOCK = threading.Lock()
_STARTED: list[bool] = []


def add(name: str, seconds: float) -> None:
    with _LOCK:
        _TIMES[name] = _TIMES.get(name, 0.0) + seconds


@contextmanager
def timed(name: str) -> Iterator[None]:
    """The block's wall time added to phase `name`."""
    start = time.monotonic()
    try:
        yield
    finally:
        add(name, time.monotonic() - start)


@contextmanager
def busy(name: str) -> Iterator[None]:
    """The block's wall time added to `name` among the threads' busy seconds (summed over the threads that run it,
    beside the phases, not on the run's critical path: what the writer's `read` wait is made of)."""
    start = time.monotonic()
    try:
        yield
    finally:
        seconds = time.monotonic() - start
        with _LOCK:
            _BUSY[name] = _BUSY.get(name, 0.0) + seconds


def take_busy() -> dict[str, float]:
    """This process's busy seconds so far (ms), and a clean slate."""
    with _LOCK:
        out = {k: round(v, 3) for k, v in _BUSY.items()}
        _BUSY.clear()
    return out


def timed_iter(items: Iterable[T], name: str) -> Iterator[T]:
    """`items`, the time spent waiting for each added to phase `name` (a writer waiting for its input: `read`)."""
    it = iter(items)
    while True:
        start = time.monotonic()
        try:
            item = next(it)
        except StopIteration:
            add(name, time.monotonic() - start)
            return
        add(name, time.monotonic() - start)
        yield item


def begin() -> None:
    """A command's first step: a clean slate (what a failed run before it left is dropped), and once per process
    the time since the process began (`startup`: the interpreter, glmconv's and click's imports), where the system
    says when that was (Linux)."""
    take(), take_busy()
    if _STARTED:
        return
    _STARTED.append(True)
    age = process_age()
    if age is not None:
        add("startup", age)


def process_age() -> float | None:
    """Seconds since this process started, from /proc (None elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def import_torch() -> None:
    """torch imported now, its import timed (`import`), unless this process already has it; its objects (and the
    plan, made before it) settled for the collector (glmconv.collector)."""
    if "torch" in sys.modules:
        return
    with timed("import"):
        import torch  # noqa: F401
    collector.settle()


def peek(name: str) -> float:
    """Seconds in phase `name` so far in this process."""
    with _LOCK:
        return _TIMES.get(name, 0.0)


def take() -> dict[str, float]:
    """This process's phases so far, in seconds (ms), and a clean slate: each figure is reported once."""
    with _LOCK:
        out = {k: round(v, 3) for k, v in _TIMES.items()}
        _TIMES.clear()
    return out


def merged(*parts: object) -> dict[str, float]:
    """Phases of processes that ran one after the other (a worker's inside the launcher's), summed by name (a part
    that is not such a dict, a summary's missing key, counts as none)."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in (part.items() if isinstance(part, dict) else ()):
            if isinstance(v, (int, float)):
                out[k] = round(out.get(k, 0.0) + v, 3)
    return out
