"""The options of how a command spreads its work, one definition for every command that has them: `--workers
N|auto`, `--read-threads`, `--device`; their ranges and choices are glmconv.arguments', as the Python API checks
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from glmconv import arguments, defaults


class Workers(click.ParamType):
    name = "N|auto"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        try:
            return arguments.workers(value)
        except arguments.ArgumentError as exc:
            self.fail(exc.detail, param, ctx)


WORKERS = Workers()


def workers_option() -> Callable[[Any], Any]:
    """`--workers`."""
    return click.option("--workers", type=WORKERS, default=str(defaults.DEFAULT_WORKERS), show_default=True,
                        help="Worker processes on this machine, or auto: one (one worker keeps one disk busy; "
                        "more only add their start). Under torchrun, one per rank instead.")


def read_threads_option(work: str, same: str = "") -> Callable[[Any], Any]:
    """`--read-threads`; `work`: what the threads do ahead of the worker's writer, `same`: what stays the same."""
    return click.option("--read-threads", type=click.IntRange(*defaults.READ_THREADS_RANGE),
                        default=defaults.DEFAULT_THREADS, show_default=True,
                        help=f"Threads per worker {work} (0: one step at a time){same}.")


def device_option(what: str, verb: str = "dequantised") -> Callable[[Any], Any]:
    """`--device`: where FP8 weights are `verb` (dequantised; export: re-quantised); `what`: after which they are cast
    or compared."""
    return click.option("--device", type=click.Choice(defaults.DEVICE_CHOICES),
                        default=defaults.DEFAULT_DEVICE, show_default=True,
                        help=f"Where FP8 weights are {verb} and {what} (the same bits everywhere); auto: the "
                        "GPU when one is visible and a worker has at least 64 MiB of FP8 codes.")
