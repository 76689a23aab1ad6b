"""SIGINT and SIGTERM during a run: one exception, raised wherever Python is, recorded so it cannot be lost.

A signal handler that raises inside a C++ callback (torch.save's writer) comes back as a RuntimeError, which
the writers turn into a "write failed" error. So the handler also records the signal: whatever exception
then reaches `run_on_output` is reported as the interruption, and the CLI prints one line, `interrupted`,
and exits 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []
_state = {"depth": 0, "completing": False, "cli": False}  # see `catching`, `completing`, `cli_process`


class Interrupted(BaseException):
    """The run was stopped by SIGINT or SIGTERM (a BaseException, so no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state["completing"]:
        return  # the run is publishing or has published: too late to interrupt it (see `completing`)
    if not _received:
        _received.append(signum)
        raise Interrupted(signum)


def received() -> int | None:
    """The first SIGINT/SIGTERM seen since `catching()` began, if any."""
    return _received[0] if _received else None


@contextmanager
def catching() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM raise Interrupted once (later ones are ignored while cleaning up).

    Outside the main thread signal handlers cannot be set; the block then runs with the defaults.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _state["completing"] = False
    before = {s: signal.signal(s, _handler) for s in SIGNALS}
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        late = _state["completing"] and _state["cli"] and not _state["depth"]
        for s, h in before.items():  # the command line, once published, ignores them until the process exits
            signal.signal(s, signal.SIG_IGN if late else h)


def cli_process() -> None:
    """The command line calls this first: a published run then ignores SIGINT/SIGTERM until its process exits."""
    _state["cli"] = True


def as_interrupt(exc: BaseException) -> BaseException:
    """`exc`, or the interruption it really is when a signal arrived (torch wraps it in a RuntimeError)."""
    sig = received()
    if sig is not None and not isinstance(exc, Interrupted):
        return Interrupted(sig)
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    return exc


@contextmanager
def completing() -> Iterator[None]:
    """From here on the run completes: SIGINT/SIGTERM are dropped until the command ends (`catching` exits).

    Publishing is a few renames that must not be split, and once OUT is in place an `interrupted` line (exit
    130/143) would report a failure that did not happen. Python runs signal handlers in the main thread
    whichever thread the kernel delivered the signal to, so this holds with reader, sync and pool threads alive
    (a signal mask set here would cover the main thread only). Outside `catching` the handlers are restored
    when the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state["completing"] = True
    before = {s: signal.signal(s, _handler) for s in SIGNALS} if not _state["depth"] else {}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        if before:
            _state["completing"] = False
