"""Text that reaches a terminal: names read from files are shown escaped, never raw.

Tensor and file names come from shard headers, index files and directory listings, which anyone can write.
A raw newline splits a one-line error in two, an ANSI escape recolours or erases the terminal, a `[bold]`
is rich markup. Every message, table cell and progress line passes names through `printable` (whole texts)
or `show` (one name), so there is one rule for what is escaped and how.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.markup import escape

MAX_SHOWN = 200  # characters of one shown value; a 5,000-digit number or a 1 MB name is cut in the middle


def printable(text: str) -> str:
    """`text` with every non-printable character (controls, bidi overrides, line separators) escaped.

    Printable text is returned unchanged, so ordinary messages are not touched.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def show(value: Any, *, quote: bool = False) -> str:
    """One name (or value) for a message: as is when plain, quoted and escaped (`repr`) when it holds
    anything non-printable (or with `quote`), so 'a\\nb' cannot be mistaken for a name with a backslash;
    cut to MAX_SHOWN characters."""
    plain = isinstance(value, str) and value.isprintable() and value and not quote
    text = value if plain else repr(value)
    if len(text) > MAX_SHOWN:
        half = MAX_SHOWN // 2
        text = f"{text[:half]}...({len(text) - 2 * half} characters)...{text[-half:]}"
    return text


def plain_markup(text: str) -> str:
    """`printable(text)` made safe to embed in rich markup (a name holding `[red]` stays literal)."""

    return escape(printable(text))


def decimal(text: str) -> int | None:
    """The number ASCII digits spell, else None: `str.isdigit` also accepts `²` and other digits int() refuses."""
    return int(text) if text.isascii() and text.isdigit() else None


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`1 shard`, `2 shards`, `1,024 HF tensors`: a count and its noun, singular only for exactly one."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


PIPE_WIDTH = 1000  # columns of a console that is not a terminal: no table wraps a tensor name when piped


def console(**kwargs: Any) -> Any:
    """A rich Console for stdout that, when stdout is not a terminal (a pipe, a file, CI logs) and COLUMNS is not
    set, is PIPE_WIDTH wide instead of rich's 80: tables keep their natural width and names stay on one line."""

    out = Console(**kwargs)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = PIPE_WIDTH
    return out
