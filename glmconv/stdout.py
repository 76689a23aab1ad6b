"""glmconv's own stdout: while a command of the command line runs, file descriptor 1 belongs to glmconv alone.

Users pipe glmconv's output into `jq` or parse it in CI, so nothing else may land there. Libraries imported
during a run do print: tilelang logs its kernel compiles through `tqdm.write` (Python's `sys.stdout` at call
time), a compiler writes to file descriptor 1 from C. `reserved()` therefore keeps a private duplicate of the
original stdout for glmconv's output and points both `sys.stdout` and descriptor 1 (which subprocesses and
workers inherit) at stderr until the command ends. Everything glmconv itself prints on stdout goes through
`stream()`: the reserved duplicate while a command runs, else whatever `sys.stdout` is (click's CliRunner, a
Python caller), so outside the command line nothing changes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TextIO

_RESERVED: list[TextIO] = []  # the private duplicate of the original stdout, while a command runs
_STATE = {"cli": False}  # see `cli_process`


def stream() -> TextIO:
    """Where glmconv's own output goes: the reserved stdout while a command-line command runs, else sys.stdout."""
    return _RESERVED[-1] if _RESERVED else sys.stdout


def cli_process() -> None:
    """The command line calls this first: from then on `reserved()` takes descriptor 1 over (never elsewhere: a
    Python caller's or a test runner's stdout is theirs)."""
    _STATE["cli"] = True


@contextmanager
def reserved() -> Iterator[None]:
    """For the block, glmconv's output alone reaches the original stdout (through `stream()`); `sys.stdout` and
    file descriptor 1 are stderr's. Outside the command-line process, or inside a reservation, it does nothing.

    On the way out glmconv's output is flushed first: a reader that went away (`glmconv ... | head`) raises
    BrokenPipeError from here, after descriptor 1 and `sys.stdout` are given back.
    """
    before = sys.stdout
    if not _STATE["cli"] or _RESERVED or before is None or sys.stderr is None:  # `>&-`, `2>&-`: nothing to keep
        yield
        return
    before.flush()  # what was printed before the command goes first, to the real stdout
    real = _duplicate()
    if real is None:
        yield
        return
    out = open(real, "w", buffering=1 if os.isatty(real) else -1, encoding=before.encoding,
               errors=before.errors, closefd=True)
    sys.stdout = sys.stderr
    _RESERVED.append(out)
    try:
        yield
    finally:
        try:
            out.flush()
        finally:
            _RESERVED.pop()
            with suppress(OSError):  # a library's own buffered prints go to stderr, as they were meant to
                before.flush()
            sys.stdout = before
            os.dup2(real, 1)
            with suppress(OSError):  # after a failed flush: what could not be written is dropped
                out.close()


def _duplicate() -> int | None:
    """A duplicate of descriptor 1, not inheritable (no worker or compiler gets the real stdout), with 1 pointed at
    stderr; None (nothing changed) where 1 or 2 is closed."""
    try:
        real = os.dup(1)
    except OSError:
        return None
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(real)
        return None
    return real


def reader_gone() -> None:
    """stdout's reader went away: glmconv's stdout (reserved or not) now writes to /dev/null, so the exit's flush
    and whatever is still buffered cannot fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, stream().fileno())
    os.close(null)
