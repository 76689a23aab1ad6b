"""Progress for long jobs: rich bars on a terminal, a plain line each LOG_EVERY_S in a log.

Bytes are counted once written (a write or copy_file_range returned), never when queued; tensors once their last
byte is written. On a terminal each phase of a run (plan, copy, flush, verify, publish) gets a line when it
starts (`say`), the first at once, before torch is imported, and the bar shows what is known: `starting` until
anything is read, the bytes read while a writer fills its first group, then the written bytes, the rate and an
ETA. Every line fits BAR_COLUMNS (80) and none wraps. A stderr that is not a terminal (a pipe, a log file) gets no
bar and no phase line; a data-moving command (`Progress`) writes one plain line each LOG_EVERY_S there, so that a
cluster job's log shows a long run moving; parity's steps (`StepProgress`) write none.

The ETA follows the writer's own timeline: the time it spends waiting for input (`queued`: a DCP writer filling a
group) and the time it spends writing (`advance`), each measured from the first event on (what comes before, torch's
import and the first read, is no rate); the rest of each at its own measured pace. Without `queued` (export,
verify) the time between writes is the pipeline's pace. A first burst of writes after a long read thus no longer
reads as a slow run (the ETA that was 4x to 10x too long).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from glmconv.text import printable

PLAN, COPY, FLUSH, VERIFY, PUBLISH = "plan", "copy", "flush", "verify", "publish"
BAR_COLUMNS = 80  # the bar's line fits a terminal this wide: the bar itself takes what the text leaves
STEP_SHOWN = 24  # characters of a parity step's name on its bar
LOG_EVERY_S = 30.0  # a log (stderr no terminal) gets a plain progress line of a data-moving command this often


def on_terminal() -> bool:
    """stderr is a terminal: phases and bars are shown (a pipe or a log file gets neither)."""
    return sys.stderr.isatty()


def say(label: str, phase: str, detail: str = "", *, enabled: bool = True) -> None:
    """One line `LABEL: PHASE DETAIL` on a terminal's stderr, at once (cheap: nothing heavy is imported)."""
    if enabled and on_terminal():
        print(f"{printable(label)}: {phase}{' ' + printable(detail) if detail else ''}", file=sys.stderr, flush=True)


class Progress:
    """Counts written bytes and finished tensors against known totals; silent when `enabled` is False (--json)."""

    def __init__(self, label: str, total_bytes: int, total_items: int, *, enabled: bool = True,
                 noun: str = "tensors", console: Console | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.label, self.total_bytes, self.total_items, self.noun = label, total_bytes, total_items, noun
        self.done_bytes = self.done_items = self.queued_bytes = 0
        self.enabled = enabled
        self.phase_name = ""
        self._console = console  # a rich Console to draw the bar on (tests); None: stderr, when it is a terminal
        self._rich: RichProgress | None = None
        self._task: TaskID | None = None
        self._clock = clock or time.monotonic  # tests pass their own
        self._start = self._last_byte = self._last_line = self._clock()
        self._log = False  # stderr is a log, not a terminal: plain lines every LOG_EVERY_S instead of a bar
        self._t_prev: float | None = None  # the writer's last event (a queued chunk or a write); None: none yet
        self._wait_s = self._write_s = 0.0  # the writer's time waiting for input, and writing, since its first event
        self._wait_bytes = self._write_bytes = 0  # the bytes those times measure

    def __enter__(self) -> Progress:
        if self.enabled and (self._console is not None or on_terminal()):
            console = self._console or Console(stderr=True)
            console.width = min(console.width, BAR_COLUMNS)
            rich = self._rich = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=None),
                                             TextColumn("{task.fields[counts]}", markup=False), console=console,
                                             transient=True, expand=True)
            rich.__enter__()
            self._task = rich.add_task(self._description(), total=self.total_bytes, counts=self._counts())
        else:
            self._log = self.enabled and self._console is None
        return self

    def queued(self, nbytes: int) -> None:
        """`nbytes` more read and held for the writer (a DCP group filling): the bar says so until the first write,
        and the ETA learns the reading pace. Never counted as done."""
        self._event(nbytes, waiting=True)
        self.queued_bytes += nbytes
        if self._rich is not None and self._task is not None and not self.done_bytes:
            self._rich.update(self._task, counts=self._counts())

    def advance(self, nbytes: int, items: int = 1) -> None:
        """`nbytes` more written and `items` more tensors finished."""
        self._event(nbytes, waiting=False)
        self.done_bytes += nbytes
        self.done_items += items
        if nbytes:
            self._last_byte = self._clock()
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, advance=nbytes, counts=self._counts())
        elif self._log and self._clock() - self._last_line >= LOG_EVERY_S:  # a long job's log shows it moving
            self._last_line = self._clock()
            print(self.line(), file=sys.stderr, flush=True)

    def phase(self, name: str, detail: str = "", *, quiet: bool = False) -> None:
        """A new phase starts: the bar names it and, unless `quiet` (a brief flush between writes), a line says it."""
        if name == self.phase_name:
            return
        self.phase_name = name
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, description=self._description())
            if not quiet:
                console = self._rich.console
                console.print(fitted(self._phase_text(name, detail), console.width), markup=False, highlight=False,
                              soft_wrap=True)

    def rate(self) -> float:
        """Bytes per second from the start to the last byte written: the one figure the bar, the line and the
        summary all show."""
        return self.done_bytes / max(self._last_byte - self._start, 1e-9)

    def eta_s(self) -> float | None:
        """Seconds left: the bytes still to write at the measured writing pace, plus (where the writer waits for
        groups to fill) the bytes still to read at the measured reading pace; None until a pace is measured."""
        if self.done_bytes >= self.total_bytes:
            return 0.0
        if not (self._write_s > 0 and self._write_bytes > 0):
            return None
        left = (self.total_bytes - self.done_bytes) * self._write_s / self._write_bytes
        if self._wait_s > 0 and self._wait_bytes > 0:
            left += max(self.total_bytes - max(self.queued_bytes, self.done_bytes), 0) * self._wait_s / self._wait_bytes
        return left

    def summary_line(self) -> str:
        """What the copy phase wrote: real bytes and finished tensors, with the time to its last byte and rate."""
        return (f"{self.done_bytes / 1e9:.3f} GB written, {self._items()} in {self._last_byte - self._start:.1f}s "
                f"({self.rate() / 1e6:.0f} MB/s)")

    def copy_done(self) -> str:
        """The flush line's detail: what the copy wrote, its time and rate, short enough that the line fits
        BAR_COLUMNS (`summary_line` says the same at length)."""
        return (f"(copy done: {self.done_bytes / 1e9:.3f} GB, {self.done_items:,} tensors, "
                f"{self._last_byte - self._start:.1f}s, {self.rate() / 1e6:.0f} MB/s)")

    def line(self) -> str:
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        return (f"{printable(self.label)}: {pct:5.1f}% {self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, "
                f"{self.done_items}/{self.total_items} {self.noun}, {self.rate() / 1e6:.0f} MB/s, ETA {self._eta()}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.__exit__(exc_type, exc, tb)

    def _event(self, nbytes: int, *, waiting: bool) -> None:
        """One event of the writer's timeline: the time since the previous one was spent waiting for input (this
        event queues) or writing (it writes); the first event only starts the clock."""
        now = self._clock()
        if self._t_prev is not None:
            if waiting:
                self._wait_s, self._wait_bytes = self._wait_s + now - self._t_prev, self._wait_bytes + nbytes
            else:
                self._write_s, self._write_bytes = self._write_s + now - self._t_prev, self._write_bytes + nbytes
        self._t_prev = now

    def _items(self) -> str:
        return f"{self.done_items:,}/{self.total_items:,} {self.noun}"

    def _eta(self) -> str:
        return seconds(self.eta_s())

    def _counts(self) -> str:
        """The bar's text: GB done of total, tensors, then the rate and ETA of `line` (no noun: 80 columns); before
        the first write, what is known instead (`starting`, or the bytes read so far)."""
        done = f"{self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB {self.done_items:,}/{self.total_items:,}"
        if self.done_bytes or self.done_items:
            return f"{done} {self.rate() / 1e6:.0f} MB/s ETA {self._eta()}"
        return f"{done} reading {self.queued_bytes / 1e9:.2f} GB" if self.queued_bytes else f"{done} starting"

    def _description(self) -> str:
        return f"{printable(self.label)}: {self.phase_name}" if self.phase_name else printable(self.label)

    def _phase_text(self, name: str, detail: str) -> str:
        return f"{printable(self.label)}: {name}{' ' + printable(detail) if detail else ''}"


class StepProgress:
    """Counts steps (parity's sub-blocks): a rich bar with the step, the elapsed time and an ETA on a terminal;
    nothing at all elsewhere."""

    def __init__(self, label: str, total: int, *, enabled: bool = True, console: Console | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.done = 0
        self._console, self._clock = console, clock or time.monotonic  # tests pass their own clock
        self._rich: RichProgress | None = None
        self._task: TaskID | None = None
        self._start = self._clock()

    def __enter__(self) -> StepProgress:
        if self.enabled and (self._console is not None or on_terminal()):
            console = self._console or Console(stderr=True)
            console.width = min(console.width, BAR_COLUMNS)
            self._rich = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=None),
                                      TextColumn("{task.fields[counts]}", markup=False), TimeElapsedColumn(),
                                      TextColumn("{task.fields[eta]}", markup=False), console=console,
                                      transient=True, expand=True)
            self._rich.__enter__()
            self._task = self._rich.add_task(printable(self.label), total=self.total, counts=self._counts(""),
                                             eta=self._eta())
        self._start = self._clock()
        return self

    def __call__(self, step: str) -> None:
        self.done += 1
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, advance=1, counts=self._counts(step), eta=self._eta())

    def eta_s(self) -> float | None:
        """Seconds left at the mean time per step so far; None before the first step."""
        if not self.done:
            return None
        return (self._clock() - self._start) / self.done * max(self.total - self.done, 0)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.__exit__(exc_type, exc, tb)

    def _counts(self, step: str) -> str:
        """Steps done of total and the last step's name (the elapsed time follows, ticking, then the ETA)."""
        return f"{self.done}/{self.total} {fitted(printable(step), STEP_SHOWN)}".rstrip()

    def _eta(self) -> str:
        return f"ETA {seconds(self.eta_s())}"


def seconds(value: float | None) -> str:
    """An ETA in whole seconds, rounded up (a second left is never shown as 0s); `?` while unknown."""
    return "?" if value is None else f"{math.ceil(value - 1e-9):.0f}s"


def fitted(line: str, width: int = BAR_COLUMNS) -> str:
    """`line` cut to `width` columns (`...` at the end): a phase line printed above a bar never wraps."""
    return line if len(line) <= width else line[:width - 3] + "..."


def erase_bar() -> None:
    """Erase the terminal line a bar is drawn on and show the cursor again: what a worker process killed while its
    bar was up (Ctrl-C, a dead peer) leaves behind, before the parent's `interrupted` or error line."""
    if on_terminal():
        sys.stderr.write("\r\x1b[2K\x1b[?25h")
        sys.stderr.flush()


@contextmanager
def workers_bar(workers: int, enabled: bool) -> Iterator[None]:
    """Around a run whose rank 0 is a worker process drawing the bar (`--workers N`, N > 1): on any failure, the
    bar it may have left is erased (`erase_bar`) before the failure is reported."""
    try:
        yield
    except BaseException:
        if enabled and workers > 1:
            erase_bar()
        raise
