"""The parity report's JSON Schema: documented in docs/, derived from the records and the metric declaration,
strict, and adding a metric through the declaration alone reaches the bounds, the JSON and the table."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from helpers.report_schema import SCHEMA_DOC, check
from rich.console import Console

from glmconv.compare import metric_table
from glmconv.compare.capture import Capture
from glmconv.compare.inputs import random_batch
from glmconv.compare.metrics import parse_bound
from glmconv.compare.options import ParityOptions
from glmconv.compare.records import SubBlockRecord
from glmconv.compare.report import build_report, print_table, to_markdown
from glmconv.compare.schema import schema_text
from glmconv.models.conventions import Conventions, Sides

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden" / "parity-report.json"


def _capture() -> Capture:
    recs = [SubBlockRecord(0, "attention", "kda", "dense", 1e-7, 3e-7),
            SubBlockRecord(0, "mlp", "kda", "moe", 2e-3, 5e-2)]
    logits = {"logprob_abs_diff": {"mean": 1e-3, "p99": 5e-3, "max": 8e-3}, "top1_agreement": 1.0, "kl": 2e-5,
              "positions": 64, "next_token_positions": 63}
    return Capture(layers=recs, logits=logits)


def _report(*bounds: str) -> dict:
    opts = ParityOptions(hf_dir=Path("hf"), mcore_dir=Path("mc"), bounds=tuple(parse_bound(b) for b in bounds))
    return build_report(_capture(), opts, random_batch(512, 64, 2, 0), Sides(Conventions(), Conventions()))


def test_the_documented_schema_is_the_derived_one() -> None:
    assert SCHEMA_DOC.read_text() == schema_text(), "regenerate: python -c 'import glmconv.compare.schema as s; " \
        "open(\"docs/parity-report.schema.json\", \"w\").write(s.schema_text())'"


def test_the_golden_report_follows_the_schema() -> None:
    check(json.loads(GOLDEN.read_text()))


def test_a_key_the_schema_does_not_name_fails() -> None:
    report = _report()
    with pytest.raises(pytest.fail.Exception, match="at layers/1: 'undeclared' does not match any of the regexes"):
        check({**report, "layers": [report["layers"][0], {**report["layers"][1], "undeclared": 1.0}]})


def test_a_number_of_the_wrong_type_fails() -> None:
    with pytest.raises(pytest.fail.Exception, match="at summary/kl: 'small' is not of type 'number', 'null'"):
        check({**_report(), "summary": {**_report()["summary"], "kl": "small"}})


def test_a_metric_added_through_the_declaration_alone_is_in_the_bounds_the_json_and_the_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def largest_max_abs(records: metric_table.Records, logits: dict) -> float | None:
        return metric_table.nanmax([r.max_abs for r in records])

    column = metric_table.number_column("max abs", "max_abs")
    added = metric_table.Metric("max_abs.max", "absolute", "the largest elementwise stream difference",
                                largest_max_abs, record_field="max_abs", column=column)
    monkeypatch.setattr(metric_table, "METRICS", (*metric_table.METRICS, added))
    report = _report("max_abs.max>0.01")
    assert report["summary"]["max_abs.max"] == 5e-2
    assert report["bounds"] == [{"bound": "max_abs.max>0.01", "metric": "max_abs.max", "op": ">", "limit": 0.01,
                                 "value": 5e-2, "broken": True}]
    assert not report["passed"]
    out = io.StringIO()
    print_table(report, Console(file=out, width=200))
    assert "max abs" in out.getvalue() and "5.000e-02" in out.getvalue()
    assert "| max abs |" in to_markdown(report)
    schema = json.loads(schema_text())
    assert schema["properties"]["summary"]["properties"]["max_abs.max"]["description"] == (
        "the largest elementwise stream difference (absolute)")


def test_every_record_field_is_in_the_schema() -> None:
    fields = {f.name for f in dataclasses.fields(SubBlockRecord)} - {"topk", "experts"}
    props = json.loads(schema_text())["properties"]["layers"]["items"]["properties"]
    assert fields | {"topk_overlap", "topk_noise", "topk_ref_overlap", "topk_excess", "expert_overlap",
                     "experts_noise", "experts_ref_overlap", "experts_excess"} == set(props)
