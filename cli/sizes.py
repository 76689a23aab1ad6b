"""Human sizes on the command line: 5GB, 512MiB, 1e9, 1.5GiB.

Parsed exactly (Decimal, never float: `1e999` is not infinity, `0.1` is not 0.1000000000000000055) and
bounded, so a typo is a usage error (exit 2) and never an OverflowError or a zero-byte group.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

import click

from glmconv.arguments import MAX_SIZE, SEED_RANGE
from glmconv.text import show

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
_SIZE = re.compile(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")
_EXPECTED = "expected a size such as 5GB, 512MiB or 1000000"


def parse_size(text: str) -> int:
    """Bytes in `text`; a click.BadParameter (one usage-error line, exit 2) when it is not a size in range."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise click.BadParameter(f"{show(text)}: {_EXPECTED}")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:  # the pattern admits only decimal numbers; kept as a guard
        raise click.BadParameter(f"{show(text)}: {_EXPECTED}") from None
    if number > Decimal(MAX_SIZE) / _UNITS[unit]:
        raise click.BadParameter(f"{show(text)}: larger than the largest size accepted, 1PiB ({MAX_SIZE} bytes)")
    size = int(number * _UNITS[unit])
    if size < 1:
        raise click.BadParameter(f"{show(text)}: a size must be at least 1 byte")
    return size


class SizeType(click.ParamType):
    """A click option type for sizes: checked while the command line is parsed, before any work starts."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_size(str(value))
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


SIZE = SizeType()


class SeedType(click.ParamType):
    """A seed as torch.Generator.manual_seed takes it: anything else is a usage error, not an OverflowError. The
    range is said in words (SEED_HELP), not as click's 20-digit bounds that break across help lines."""

    name = "integer"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            number = value if isinstance(value, int) and not isinstance(value, bool) else int(str(value).strip())
        except ValueError:
            self.fail(f"{show(str(value))}: expected a whole number", param, ctx)
        if not SEED_RANGE[0] <= number <= SEED_RANGE[1]:
            self.fail(f"{show(str(number))}: expected a seed from -2**63 to 2**64-1", param, ctx)
        return number


SEED = SeedType()
SEED_HELP = "any whole number from -2**63 to 2**64-1"
