"""`--workers N|auto` on the command line: checked by glmconv.arguments.workers, as the Python API checks it."""

from __future__ import annotations

import click

from glmconv import arguments


class Workers(click.ParamType):
    name = "N|auto"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        try:
            return arguments.workers(value)
        except arguments.ArgumentError as exc:
            self.fail(exc.detail, param, ctx)


WORKERS = Workers()
