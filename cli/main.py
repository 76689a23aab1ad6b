"""glmconv command line: convert, export, audit-names, verify, parity, fixture."""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import click

from glmconv import collector, interrupt, stdout
from glmconv.errors import GlmconvError
from glmconv.interrupt import Interrupted
from glmconv.runners import ranks
from glmconv.text import printable
from glmconv.version import __version__
from glmconv_cli import report

# Each command and where it lives, imported when it runs (or when --help lists them): a convert never loads the
# parity stack, and the start of every run (Python's imports, slow on a cluster's shared filesystem) stays small.
COMMANDS = {"audit-names": "glmconv_cli.audit_cmd:audit_names", "bench": "glmconv_cli.bench_cmd:bench",
            "convert": "glmconv_cli.convert_cmd:convert", "export": "glmconv_cli.export_cmd:export",
            "fixture": "glmconv_cli.fixture_cmd:fixture",
            "megatron-args": "glmconv_cli.megatron_args_cmd:megatron_args", "parity": "glmconv_cli.parity_cmd:parity",
            "relayout": "glmconv_cli.relayout_cmd:relayout", "verify": "glmconv_cli.verify_cmd:verify"}

INTERNAL_EXIT = 3  # a bug in glmconv: 1 keeps meaning "findings"/"bound broken", 2 "bad input"
REPORT_HINT = "please report this on the glmconv issue tracker with the command line"


class _Group(click.Group):
    """Every failure is one line on stderr and a meaningful exit code, never a traceback.

    GlmconvError (bad input) and click's usage errors (bad flags) exit 2; any other exception is a bug and
    exits 3 with a line asking for a report. SIGINT/SIGTERM (Interrupted, KeyboardInterrupt) are
    `interrupted`, exit 130/143; they are BaseExceptions, so the exit-3 guard never sees them.
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        if cmd_name not in self.commands:
            module, attr = COMMANDS[cmd_name].split(":")
            command = getattr(importlib.import_module(module), attr)
            _reserving_stdout(command)
            self.add_command(command, cmd_name)
        return self.commands[cmd_name]

    def invoke(self, ctx: click.Context) -> object:
        with interrupt.catching():  # SIGINT/SIGTERM anywhere in a command: `interrupted`, exit 130/143
            return self._invoke(ctx)

    def _invoke(self, ctx: click.Context) -> object:
        try:
            return _interruptible(super().invoke, ctx)
        except Interrupted as exc:  # SIGINT/SIGTERM: the run already removed its staging and released its lock
            _fail("interrupted", exc.exit_code)
        except KeyboardInterrupt:  # Ctrl-C outside a run (while reading the input): nothing to clean up
            _fail("interrupted", 128 + signal.SIGINT)
        except GlmconvError as exc:
            _fail(f"error: {one_line(str(exc))}", exc.exit_code)
        except click.exceptions.NoArgsIsHelpError:  # a group without its subcommand: its help, as `glmconv` alone
            raise  # gives (click prints it whole on stderr, exit 2): the help is many lines, never one error line
        except click.UsageError as exc:
            _fail(f"error: {one_line(exc.format_message())}", exc.exit_code)
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise
        except BrokenPipeError:
            _reader_gone()
        except Exception as exc:
            _fail(internal_error_line(exc, saved_traceback(exc)), INTERNAL_EXIT)


def _interruptible(invoke: Callable[[click.Context], object], ctx: click.Context) -> object:
    """`invoke(ctx)`; once SIGINT/SIGTERM arrived, whatever it raised is the interruption.

    torch turns an exception raised in its callbacks into a RuntimeError, which may then become a "write
    failed" error line: the recorded signal decides instead.
    """
    try:
        return invoke(ctx)
    except BaseException as exc:
        really = interrupt.as_interrupt(exc)
        if really is exc:
            raise
        raise really from None


def _reader_gone() -> NoReturn:
    """stdout's reader went away (`glmconv ... | head`): stop quietly with SIGPIPE's status, like any Unix tool."""
    stdout.reader_gone()  # glmconv's stdout, reserved or not, goes to /dev/null: the exit flush must not fail again
    sys.exit(128 + signal.SIGPIPE)


def _fail(line: str, code: int) -> NoReturn:
    click.echo(line, err=True)
    sys.exit(code)


def internal_error_line(exc: BaseException, trace: str | None = None) -> str:
    """`internal error: <Type>: <message>; please report ...` on one line, naming the saved traceback if any."""
    message = one_line(str(exc))
    where = f" and the traceback in {one_line(trace)}" if trace else ""
    return f"internal error: {type(exc).__name__}{': ' + message if message else ''}; {REPORT_HINT}{where}"


def saved_traceback(exc: BaseException) -> str | None:
    """The bug's traceback in a new file of the temp folder (the report needs it; the terminal gets one line), or
    None where none can be written. mkstemp creates it (O_EXCL, mode 0600): no existing path or link is followed."""
    try:
        fd, path = tempfile.mkstemp(prefix="glmconv-internal-error-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(f"glmconv {__version__}: {' '.join(sys.argv)}\n")
            f.write("".join(traceback.format_exception(exc)))
    except Exception:  # a full or read-only temp folder: the one line still goes out
        return None
    return path


def one_line(text: str) -> str:
    """The message as one printable line: newlines and control characters (names read from files) escaped."""
    return printable(text)


@click.group(cls=_Group, context_settings={"show_default": True})  # every command shows its defaults
@click.version_option(__version__, prog_name="glmconv")
def cli() -> None:
    """Move GLM-5.3-Flash between HF and Megatron-core checkpoints, and prove they compute the same.

    Exit codes: 0 success, 1 audit findings or a broken parity bound, 2 bad input, 3 internal error (a bug).
    """


def _reserving_stdout(command: click.Command) -> None:
    """Every command's body runs with stdout reserved for glmconv's output (glmconv/stdout.py): a library's prints
    and its C-level writes go to stderr. Parsing, --help, --version and usage errors, which click prints, come first
    and keep their streams. Outside `main()` (click's CliRunner, a Python caller) nothing is reserved."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _reserving_stdout(sub)
        return
    body = command.callback
    if body is None:
        return

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        with stdout.reserved():
            return body(*args, **kwargs)

    command.callback = run



def main() -> None:
    ranks.cli_ends_the_process()
    interrupt.cli_process()  # once published, a late SIGINT/SIGTERM is ignored until the process exits
    stdout.cli_process()  # a command's stdout is glmconv's alone: libraries print to stderr (glmconv/stdout.py)
    collector.cli_process()  # long-lived objects kept out of each collection (glmconv/collector.py)
    try:
        cli(prog_name="glmconv")
    except SystemExit as done:
        try:
            stdout.stream().flush()  # what is still buffered goes now, while a closed pipe can be told apart
        except BrokenPipeError:
            _reader_gone()
        sys.stderr.flush()
        ranks.leave_now(_code(done))  # a torchrun rank: no gloo teardown (glmconv/runners/ranks.py)
        report.leave_quickly(_code(done))  # a data command: no torch teardown (glmconv_cli/report.py)
        raise


def _code(done: SystemExit) -> int:
    """The status `sys.exit` would give: an int as is, None 0, anything else (a message) 1."""
    return done.code if isinstance(done.code, int) else 0 if done.code is None else 1


if __name__ == "__main__":
    main()
