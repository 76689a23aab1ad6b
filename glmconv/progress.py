"""Progress for long jobs: rich bars on a terminal, a plain line every few seconds otherwise.

Bytes are counted once written (a write or copy_file_range returned), never when queued; tensors once their last
byte is written. On a terminal each phase of a run (plan, copy, flush, verify, publish) gets a line when it
starts (`say`), the first at once, before torch is imported; a pipe keeps the periodic plain lines alone.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, TaskID, TextColumn
from rich.progress import Progress as RichProgress

from glmconv.text import printable

if TYPE_CHECKING:
    pass

PLAN, COPY, FLUSH, VERIFY, PUBLISH = "plan", "copy", "flush", "verify", "publish"
BAR_COLUMNS = 80  # the bar's line fits a terminal this wide: the bar itself takes what the text leaves


def on_terminal() -> bool:
    """stderr is a terminal: phases are shown (a pipe or a log file gets the plain periodic lines only)."""
    return sys.stderr.isatty()


def say(label: str, phase: str, detail: str = "", *, enabled: bool = True) -> None:
    """One line `LABEL: PHASE DETAIL` on a terminal's stderr, at once (cheap: nothing heavy is imported)."""
    if enabled and on_terminal():
        print(f"{printable(label)}: {phase}{' ' + printable(detail) if detail else ''}", file=sys.stderr, flush=True)


class Progress:
    """Counts written bytes and finished tensors against known totals; silent when `enabled` is False (--json)."""

    def __init__(self, label: str, total_bytes: int, total_items: int, *, enabled: bool = True,
                 every_s: float = 5.0, noun: str = "tensors", console: Console | None = None) -> None:
        self.label, self.total_bytes, self.total_items, self.noun = label, total_bytes, total_items, noun
        self.done_bytes = self.done_items = 0
        self.enabled, self.every_s = enabled, every_s
        self.phase_name = ""
        self._console = console  # a rich Console to draw the bar on (tests); None: stderr, when it is a terminal
        self._rich: RichProgress | None = None
        self._task: TaskID | None = None
        self._start = self._last = self._last_byte = time.monotonic()

    def __enter__(self) -> Progress:
        if self.enabled and (self._console is not None or on_terminal()):
            console = self._console or Console(stderr=True)
            console.width = min(console.width, BAR_COLUMNS)
            rich = self._rich = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=None),
                                      TextColumn("{task.fields[counts]}", markup=False), console=console,
                                      transient=True, expand=True)
            rich.__enter__()
            self._task = rich.add_task(self._description(), total=self.total_bytes, counts=self._counts())
        return self

    def advance(self, nbytes: int, items: int = 1) -> None:
        """`nbytes` more written and `items` more tensors finished."""
        self.done_bytes += nbytes
        self.done_items += items
        if nbytes:
            self._last_byte = time.monotonic()
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, advance=nbytes, counts=self._counts())
        elif self.enabled and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def phase(self, name: str, detail: str = "", *, quiet: bool = False) -> None:
        """A new phase starts: the bar names it and, unless `quiet` (a brief flush between writes), a line says it."""
        if name == self.phase_name:
            return
        self.phase_name = name
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, description=self._description())
            if not quiet:
                self._rich.console.print(self._phase_text(name, detail), markup=False, highlight=False)

    def rate(self) -> float:
        """Bytes per second from the start to the last byte written: the one figure the bar, the periodic line
        and the summary all show."""
        return self.done_bytes / max(self._last_byte - self._start, 1e-9)

    def summary_line(self) -> str:
        """What the copy phase wrote: real bytes and finished tensors, with the time to its last byte and rate."""
        return (f"{self.done_bytes / 1e9:.3f} GB written, {self._items()} in {self._last_byte - self._start:.1f}s "
                f"({self.rate() / 1e6:.0f} MB/s)")

    def line(self) -> str:
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        return (f"{printable(self.label)}: {pct:5.1f}% {self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, "
                f"{self.done_items}/{self.total_items} {self.noun}, {self.rate() / 1e6:.0f} MB/s, ETA {self._eta()}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.__exit__(exc_type, exc, tb)

    def _items(self) -> str:
        return f"{self.done_items:,}/{self.total_items:,} {self.noun}"

    def _eta(self) -> str:
        rate = self.rate()
        return f"{(self.total_bytes - self.done_bytes) / rate:.0f}s" if rate else "?"

    def _counts(self) -> str:
        """The bar's text: GB done of total, tensors, the rate and ETA of `line` (no noun: 80 columns)."""
        return (f"{self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB {self.done_items:,}/{self.total_items:,}"
                f" {self.rate() / 1e6:.0f} MB/s ETA {self._eta()}")

    def _description(self) -> str:
        return f"{printable(self.label)}: {self.phase_name}"

    def _phase_text(self, name: str, detail: str) -> str:
        return f"{printable(self.label)}: {name}{' ' + printable(detail) if detail else ''}"
