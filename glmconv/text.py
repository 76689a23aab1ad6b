"""Text that reaches a terminal: names read from files are shown escaped, never raw.

Tensor and file names come from shard headers, index files and directory listings, which anyone can write.
A raw newline splits a one-line error in two, an ANSI escape recolours or erases the terminal, a `[bold]`
is rich markup. Every message, table cell and progress line passes names through `printable` (whole texts)
or `show` (one name), so there is one rule for what is escaped and how.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from rich.console import Console
from rich.markup import escape

from glmconv import stdout

MAX_SHOWN = 200  # characters of one shown value; a 5,000-digit number or a 1 MB name is cut in the middle
MAX_JSON_DEPTH = 64  # nesting of a --json value; deeper (only a crafted common state nests so) is shown as a string


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
    """A rich Console for glmconv's stdout (`glmconv.stdout.stream()`, the reserved one while a command runs) that,
    when it is not a terminal (a pipe, a file, CI logs) and COLUMNS is not set, is PIPE_WIDTH wide instead of rich's
    80: tables keep their natural width and names stay on one line. A terminal is as wide as that terminal."""

    if "file" not in kwargs and not kwargs.get("stderr"):
        kwargs["file"] = stdout.stream()
    out = Console(**kwargs)
    if "COLUMNS" not in os.environ and "width" not in kwargs:
        width = _terminal_width(out.file) if out.is_terminal else PIPE_WIDTH
        if width:
            out.width = width
    return out


PIPE_TABLE_WIDTH = 100  # columns a table of numbers is laid out in when piped: a log is read in a terminal later


def table_width(out: Any) -> int:
    """The columns a table of numbers (parity's) is laid out in on `out`, a `console()`: its width (a terminal's,
    or COLUMNS'), or PIPE_TABLE_WIDTH when it is no terminal and COLUMNS is not set. A table of names keeps
    PIPE_WIDTH there (a name stays on one line); a table of numbers drops columns to fit instead, and a log read
    later in a terminal does not wrap it."""
    if not out.is_terminal and "COLUMNS" not in os.environ:
        return min(out.width, PIPE_TABLE_WIDTH)
    return int(out.width)


def _terminal_width(file: Any) -> int | None:
    """The width of the terminal `file` is (rich asks descriptors 0-2, and 1 is stderr's while a command runs);
    None, rich's own guess kept, where it is no terminal rich was told it is one (FORCE_COLOR)."""
    try:
        return os.get_terminal_size(file.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def json_text(value: Any, *, indent: int | None = None) -> str:
    """`value` as strict JSON (RFC 8259), which every parser reads; every `--json` and report.json print this.

    Whatever the value holds: a NaN or infinite float is the string "nan", "inf" or "-inf" (JSON has no such
    number, and a bare null would lose what it was). A report that knows why a number is missing says so instead:
    the parity report has no NaN or infinity left (glmconv.compare.report.finite_numbers: null, and the reason in
    `<field>_why` beside it), so a reader comparing its numbers meets a number or null, never a string. A value
    JSON has no type for (a set, bytes, a path, an object unpickled from a trainer's common state) is its `repr`,
    cut as `show` cuts it; so is a container that holds itself, or one nested deeper than MAX_JSON_DEPTH. Keys
    become strings. Shown rather than refused: these values come from a run that already did its work (relayout
    prints the iteration of the common state it published), and a refusal then would report a failure that did
    not happen.
    """
    return json.dumps(_strict(value, 0, set()), indent=indent, allow_nan=False)


def _strict(x: Any, depth: int, open_: set[int]) -> Any:
    if x is None or isinstance(x, str | bool):
        return x
    if isinstance(x, int):
        return x if _spellable(x) else _huge(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)  # 'nan', 'inf', '-inf'
    if not isinstance(x, dict | list | tuple):
        return _shown(x)
    if id(x) in open_ or depth >= MAX_JSON_DEPTH:
        return _shown(x)
    open_.add(id(x))
    try:
        if isinstance(x, dict):
            return {_key(k): _strict(v, depth + 1, open_) for k, v in x.items()}
        return [_strict(v, depth + 1, open_) for v in x]
    finally:
        open_.discard(id(x))


def _key(k: Any) -> str:
    """A key as `json.dumps` spells a str, bool, int, float or None key; any other as its `repr`."""
    if isinstance(k, str):
        return k
    if isinstance(k, float) and not math.isfinite(k):
        return str(k)  # as a value is shown
    if isinstance(k, int) and not _spellable(k):
        return _huge(k)
    if k is None or isinstance(k, bool | int | float):
        return json.dumps(k)
    return _shown(k)


def _spellable(n: int) -> bool:
    """Whether Python writes `n` out: beyond sys.int_info's digit limit (4,300 by default) it raises ValueError."""
    try:
        int.__repr__(n)
    except ValueError:
        return False
    return True


def _huge(n: int) -> str:
    return f"<an integer of {n.bit_length():,} bits>"


def _shown(x: Any) -> str:
    try:
        return show(x, quote=True)
    except RecursionError:
        return f"<a {type(x).__name__} nested too deep to show>"
    except Exception:  # a repr that fails: the type is all there is to show
        return f"<a {type(x).__name__}>"
