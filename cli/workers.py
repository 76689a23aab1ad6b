"""`--workers N|auto` on the command line: a count from 1 to 256, or `auto` (glmconv/runners/workers.py)."""

from __future__ import annotations

import click

from glmconv.text import decimal, show

MAX_WORKERS = 256


class Workers(click.ParamType):
    name = "N|auto"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if isinstance(value, int) or value == "auto":
            return value
        text = str(value)
        n = decimal(text.strip())
        if n is not None and 1 <= n <= MAX_WORKERS:
            return n
        self.fail(f"{show(text)}: expected a count from 1 to {MAX_WORKERS}, or auto", param, ctx)


WORKERS = Workers()
