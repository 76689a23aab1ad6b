"""What the data commands (convert, export, relayout, verify) share, one copy for all: the exit codes in their help,
the first line at once, and at their end the summary reported once (on torchrun rank 0 alone), its warnings on
stderr even with --json, the summary itself for --json, and an exit without torch's teardown."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from glmconv import api
from glmconv.progress import PLAN, say
from glmconv_cli.output import echo_json

F = TypeVar("F", bound=Callable[..., Any])

_EXIT_CODES = """

    Exit codes: 0 {done} (or planned, with --dry-run), 2 bad input (one `error:` line naming the file or
    tensor; nothing is published), 3 internal error (a bug: please report it), 130/143 interrupted (staging
    removed).
    """


def exit_codes(done: str) -> Callable[[F], F]:
    """Under `@click.command`: the command's help ends with the exit codes every data command shares."""
    def add(f: F) -> F:
        f.__doc__ = (f.__doc__ or "").rstrip() + _EXIT_CODES.format(done=done)
        return f
    return add


def begin(command: str, doing: str, as_json: bool) -> None:
    """The command's first line at once, before torch loads (none with --json); it may end quickly (below)."""
    say(command, PLAN, doing, enabled=not as_json)
    ends_quickly()


# summary keys whose line goes to stderr whatever the output mode: what the layout's trainer will not load (convert,
# relayout), what SRC lacked and --like gave (export), a --workers count capped and why (convert, export, verify)
WARNINGS = ("homeless_warning", "taken_from_like_warning", "workers_capped")


_QUICK: list[bool] = []  # this command's process may end without the interpreter's teardown


def ends_quickly() -> None:
    """A data command (convert, export, relayout, verify) says so first: once its output is flushed and every file
    closed, nothing it loaded needs the interpreter's teardown, which is torch's (0.3-0.4 s on the CPU, more with a
    CUDA context: issue 38)."""
    _QUICK.append(True)


def leave_quickly(code: int) -> None:
    """Where `ends_quickly` was said and torch is loaded: the process ends with `code` as soon as the interpreter
    starts its teardown, by the last exit handler registered (the first to run: torch's own and the modules'
    cleanup never run); a caller that catches the exit still runs until then."""
    if _QUICK and "torch" in sys.modules:
        atexit.register(_exit_now, code)


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def warn(s: dict[str, Any]) -> None:
    """The summary's warnings, one line each, on stderr."""
    for key in WARNINGS:
        if s.get(key):
            click.echo(s[key], err=True)


def reported(summary: dict[str, Any], as_json: bool) -> bool:
    """Whether the command has nothing more to print: a torchrun rank other than 0 (every rank holds the summary,
    rank 0 prints it once), or --json, printed here after the warnings."""
    if not api.lead_process():
        return True
    warn(summary)
    if as_json:
        echo_json(summary, indent=2)
    return as_json
