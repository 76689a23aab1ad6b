"""glmconv command line: convert, export, audit-names, parity, fixture."""

from __future__ import annotations

import sys

import click

from glmconv import __version__
from glmconv.errors import GlmconvError


class _Group(click.Group):
    """Turns every user-caused error into one line on stderr and a non-zero exit, never a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except GlmconvError as exc:
            click.echo(f"error: {one_line(str(exc))}", err=True)
            sys.exit(exc.exit_code)


def one_line(text: str) -> str:
    """The message as one printable line: newlines and control characters (names read from files) escaped."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="glmconv")
def cli() -> None:
    """Move GLM-5.3-Flash between HF and Megatron-core checkpoints, and prove they compute the same."""


def _register() -> None:
    from cli.audit_cmd import audit_names
    from cli.convert_cmd import convert
    from cli.export_cmd import export
    from cli.fixture_cmd import fixture
    from cli.parity_cmd import parity

    cli.add_command(audit_names)
    cli.add_command(convert)
    cli.add_command(export)
    cli.add_command(fixture)
    cli.add_command(parity)


_register()


def main() -> None:
    cli(prog_name="glmconv")


if __name__ == "__main__":
    main()
