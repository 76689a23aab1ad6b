"""Human sizes on the command line: 5GB, 512MiB, 1e9."""

from __future__ import annotations

import re

import click

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise click.BadParameter(f"{text!r}: expected a size such as 5GB, 512MiB or 1000000")
    return int(float(m.group(1)) * _UNITS[unit])
