"""Every parity report the suite builds or writes is checked against the documented schema
(docs/parity-report.schema.json, derived by glmconv.compare.schema): a conftest fixture wraps both places."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from glmconv.compare import metric_table
from glmconv.compare import report as report_mod
from glmconv.compare.schema import report_schema

SCHEMA_DOC = Path(__file__).resolve().parents[2] / "docs" / "parity-report.schema.json"


@functools.cache
def _validator(metrics: tuple[metric_table.Metric, ...]) -> jsonschema.protocols.Validator:
    return jsonschema.Draft202012Validator(report_schema())


def validator() -> jsonschema.protocols.Validator:
    """The schema of the metrics declared now (a test may declare one more)."""
    return _validator(metric_table.METRICS)


def check(report: dict[str, Any]) -> dict[str, Any]:
    """`report` if it follows the schema; else the test fails naming the first violation and where."""
    error = jsonschema.exceptions.best_match(validator().iter_errors(report))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        pytest.fail(f"parity report breaks docs/parity-report.schema.json at {where}: {error.message}")
    return report


def _checked(fn: Callable[..., Any], pick: Callable[[tuple[Any, ...], Any], dict[str, Any]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        check(pick(args, out))
        return out
    return call


@pytest.fixture(autouse=True)
def every_report_follows_the_schema(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """build_report's result (through finite_numbers, its last step) and every report.json write_report writes
    (through to_json, which it calls)."""
    monkeypatch.setattr(report_mod, "finite_numbers", _checked(report_mod.finite_numbers, lambda a, out: out))
    monkeypatch.setattr(report_mod, "to_json", _checked(report_mod.to_json, lambda a, out: a[0]))
    yield
