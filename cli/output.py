"""What a command prints on stdout, the one way: `echo` for a line, `echo_json` for `--json`.

Both write to glmconv's own stdout (`glmconv.stdout.stream()`: the stdout reserved for glmconv while a command
line runs, so no library's print can land among them), `echo_json` strict JSON (`glmconv.text.json_text`).
Messages for stderr keep `click.echo(..., err=True)`.
"""

from __future__ import annotations

from typing import Any

import click

from glmconv.stdout import stream
from glmconv.text import json_text


def echo(message: str = "") -> None:
    """One line of output on glmconv's stdout."""
    click.echo(message, file=stream())


def echo_json(value: Any, indent: int | None = None) -> None:
    """`value` as strict JSON on glmconv's stdout: every parser reads it, whatever the value holds."""
    click.echo(json_text(value, indent=indent), file=stream())
