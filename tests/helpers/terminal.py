"""glmconv on a pseudo-terminal of a given width, and what a terminal of that width would show afterwards.

`on_a_terminal` runs the CLI with stderr on a pty (stdout piped), records every write to the terminal with its
time, and can send a signal once a frame matches; `screen` replays those bytes on a minimal VT100 (the escapes
rich and glmconv use: cursor up, erase line, carriage return, SGR colours) so a test sees what stays on screen.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

GLMCONV = Path(sys.executable).with_name("glmconv")
CSI = re.compile(r"\x1b\[([0-9;?]*)([a-zA-Z])")


@dataclass
class Run:
    frames: list[tuple[float, str]]  # (seconds since start, text written to the terminal at once)
    stdout: str
    returncode: int
    signalled: bool = False

    @property
    def raw(self) -> str:
        return "".join(text for _, text in self.frames)

    def drawn(self) -> list[str]:
        """Every line ever drawn, escapes removed (a bar's redraws each count)."""
        return [line for line in re.split(r"[\r\n]", CSI.sub("", self.raw)) if line.strip()]


def read_some(main: int) -> bytes:
    """What the terminal whose controlling side is `main` has to read now; b"" once the process closed it."""
    try:
        return os.read(main, 1 << 16)
    except OSError:  # the terminal closed with the process
        return b""


def drain(main: int) -> bytes:
    """Everything written to that terminal, until the process closes it."""
    seen = b""
    while data := read_some(main):
        seen += data
    return seen


def on_a_terminal(args: list[str], columns: int = 80, *, interrupt_when: str | None = None,
                  env: dict[str, str] | None = None, timeout: float = 300) -> Run:
    """`glmconv ARGS` with stderr on a `columns`-wide pty; SIGINT the moment a frame matches `interrupt_when`."""
    main, sub = os.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    full_env = {**os.environ, "COLUMNS": str(columns), **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen([str(GLMCONV), *args], stdout=subprocess.PIPE, stderr=sub, stdin=subprocess.DEVNULL,
                            env=full_env, start_new_session=True)
    os.close(sub)
    frames: list[tuple[float, str]] = []
    signalled = False
    while time.monotonic() - start < timeout:
        ready, _, _ = select.select([main], [], [], 0.05)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        data = read_some(main)
        if not data:
            break
        frames.append((time.monotonic() - start, data.decode(errors="replace")))
        if interrupt_when and not signalled and re.search(interrupt_when, CSI.sub("", data.decode(errors="replace"))):
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the whole foreground process group
            signalled = True
    out = proc.communicate(timeout=timeout)[0].decode()
    os.close(main)
    return Run(frames, out, proc.returncode, signalled)


def screen(raw: str, columns: int = 80) -> list[str]:
    """The rows a `columns`-wide terminal shows after `raw` (trailing blanks dropped)."""
    rows: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        m = CSI.match(raw, i)
        if m:
            arg, op = m.group(1), m.group(2)
            if op == "A":
                row = max(row - int(arg or 1), 0)
            elif op == "K":
                line = rows[row]
                del line[(0 if arg == "2" else col):]
            i = m.end()
            continue
        ch = raw[i]
        i += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
        elif ch == "\x1b" or ch < " ":
            continue
        else:
            if col >= columns:  # the terminal wraps a line longer than it is wide
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            col += 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(r).rstrip() for r in rows]
