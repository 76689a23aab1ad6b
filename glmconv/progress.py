"""Progress for long jobs: rich bars on a terminal, a plain line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from glmconv.text import printable


class Progress:
    """Counts bytes and tensors against known totals; silent when `enabled` is False (e.g. --json)."""

    def __init__(self, label: str, total_bytes: int, total_items: int, *, enabled: bool = True,
                 every_s: float = 5.0) -> None:
        self.label, self.total_bytes, self.total_items = label, total_bytes, total_items
        self.done_bytes = self.done_items = 0
        self.enabled, self.every_s = enabled, every_s
        self._rich = None
        self._task = None
        self._start = self._last = time.monotonic()

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TextColumn("{task.fields[items]}", markup=False),
                                      TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self._rich.__enter__()
            self._task = self._rich.add_task(printable(self.label), total=self.total_bytes, items="")
        return self

    def advance(self, nbytes: int, items: int = 1) -> None:
        self.done_bytes += nbytes
        self.done_items += items
        if self._rich is not None:
            self._rich.update(self._task, advance=nbytes, items=f"{self.done_items}/{self.total_items} tensors")
        elif self.enabled and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = self.done_bytes / elapsed
        eta = (self.total_bytes - self.done_bytes) / rate if rate else float("inf")
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        return (f"{printable(self.label)}: {pct:5.1f}% {self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, "
                f"{self.done_items}/{self.total_items} tensors, {rate / 1e6:.0f} MB/s, ETA {eta:.0f}s")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.__exit__(exc_type, exc, tb)
