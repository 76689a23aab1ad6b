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


class Interrupted(BaseException):
    """The run was stopped by SIGINT or SIGTERM (a BaseException, so no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum: int, frame: FrameType | None) -> None:
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
    before = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def as_interrupt(exc: BaseException) -> BaseException:
    """`exc`, or the interruption it really is when a signal arrived (torch wraps it in a RuntimeError)."""
    sig = received()
    if sig is not None and not isinstance(exc, Interrupted):
        return Interrupted(sig)
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    return exc


@contextmanager
def deferred() -> Iterator[None]:
    """SIGINT/SIGTERM held back for the block: publishing is two renames that must not be split.

    A signal that arrives meanwhile is dropped: the run has completed, too late to interrupt it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        while signal.sigtimedwait(SIGNALS, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
