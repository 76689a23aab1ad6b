"""The progress bar fits an 80-column terminal and shows the one throughput figure the summary gives."""

from __future__ import annotations

import io
import re

from rich.console import Console

from glmconv.progress import Progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


def _drawn(label: str, total: int, items: int, steps: list[tuple[int, int]]) -> tuple[list[str], str]:
    """Every line the bar drew on a wide terminal, as text, and the copy summary after `steps`."""
    screen = io.StringIO()
    with Progress(label, total, items, console=Console(file=screen, width=200, force_terminal=True)) as prog:
        prog.phase("copy")
        for nbytes, n in steps:
            prog.advance(nbytes, n)
        prog._rich.refresh()  # type: ignore[union-attr]  # draw the last state now, not at the next tick
        summary = prog.summary_line()
    lines = [line for line in re.split(r"[\r\n]", ANSI.sub("", screen.getvalue())) if line.strip()]
    return lines, summary


def test_the_bar_of_a_large_multi_worker_run_fits_80_columns() -> None:
    lines, _ = _drawn("relayout [3/8]", 756_000_000_000, 123_456, [(61_728_000_000, 11_728)] * 2)
    assert max(len(line) for line in lines) <= 80, lines
    assert re.fullmatch(r"relayout \[3/8\]: copy \S+ 123\.46/756\.00 GB 23,456/123,456 \d+ MB/s ETA \d+s",
                        lines[-1].strip()), lines[-1]


def test_the_bar_shows_the_summary_throughput() -> None:
    lines, summary = _drawn("convert", 10**9, 10, [(4 * 10**8, 4), (10**8, 1)])
    bar_rate = re.search(r" (\d+) MB/s ETA", lines[-1])
    summary_rate = re.search(r"\((\d+) MB/s\)$", summary)
    assert bar_rate and summary_rate and bar_rate.group(1) == summary_rate.group(1), (lines[-1], summary)
