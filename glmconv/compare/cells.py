"""Numbers of a report as text: one formatting for the table, the Markdown and the verdict lines.

A report's non-finite numbers are null with `<field>_why` beside them (glmconv.compare.report.finite_numbers); a
cell shows such a null as what it stands for (`inf`, `nan`), never as a missing value.
"""

from __future__ import annotations

import math
from typing import Any

WHY = "_why"  # `"excess": null, "excess_why": "unbounded: ..."`: the reason a number is not there


def fmt(v: Any, spec: str = ".3e") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def num(v: Any) -> float:
    """A number to compare: a null (NaN or infinite) as infinity."""
    return math.inf if v is None else float(v)


def field_text(rec: dict[str, Any], key: str, spec: str = ".3e") -> str:
    """A record's number as text; a null one as what it stands for (`inf`, `nan`) from its reason."""
    v = rec.get(key)
    if v is None and rec.get(key + WHY):
        return "nan" if rec[key + WHY].startswith("NaN") else "inf"
    return fmt(v, spec)
