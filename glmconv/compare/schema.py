"""The parity report's JSON Schema, derived from the records (glmconv.compare.records) and the metric declaration
(glmconv.compare.metric_table): a field or a metric added there is in the schema with nothing else to edit.

docs/parity-report.schema.json is this schema as written by `glmconv.compare.schema.schema_text()`; a test keeps
the two equal and checks every report the suite makes against it. Strict: a key the schema does not name fails.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

from glmconv.compare import metric_table
from glmconv.compare.cells import WHY
from glmconv.compare.records import SELECTIONS, FirstDivergence, KernelResult, SubBlockRecord
from glmconv.text import json_text

Schema = dict[str, Any]

NUMBER: Schema = {"type": ["number", "null"]}  # null: a NaN or infinity, its reason in `<key>_why`
STRING: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}
INT: Schema = {"type": "integer"}
OBJECT: Schema = {"type": "object"}
STRINGS: Schema = {"type": "array", "items": STRING}
OBJECTS: Schema = {"type": "array", "items": OBJECT}
_WHYS = {f".*{WHY}$": STRING}  # beside any null number: why it is not a number


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _strict(properties: dict[str, Schema], required: list[str]) -> Schema:
    return {"type": "object", "properties": properties, "patternProperties": _WHYS, "required": required,
            "additionalProperties": False}


def _of_type(hint: Any) -> Schema:
    """The schema of one annotated dataclass field (its None already made optional by the caller)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _of_type(inner[0]) if len(inner) == 1 else {"anyOf": [_of_type(a) for a in inner]}
    if origin is tuple:
        return {"type": "array", "items": _of_type(typing.get_args(hint)[0])}
    if hint is KernelResult:
        return kernel_schema()
    known: dict[Any, Schema] = {float: NUMBER, int: INT, str: STRING, bool: BOOL}
    return known.get(hint, OBJECT)


def _dataclass_properties(cls: type) -> tuple[dict[str, Schema], list[str]]:
    hints = typing.get_type_hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        props[f.name] = _of_type(hints[f.name])
        optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if not optional:
            required.append(f.name)
    return props, required


def kernel_schema() -> Schema:
    props, required = _dataclass_properties(KernelResult)
    props["bound"] = {"type": "object", "additionalProperties": NUMBER}
    return _strict(props, required)


def record_schema() -> Schema:
    """One sub-block (SubBlockRecord.as_json): a selection's fields flat, as `topk_overlap`, `topk_noise`."""
    props, required = _dataclass_properties(SubBlockRecord)
    for sel in SELECTIONS:
        del props[sel.name]
        props.update({key: NUMBER for key in sel.keys()})
    props["cause"] = {"enum": ["weights", "kernel", "conventions", "upstream", "numerics"]}
    return _strict(props, required)


def first_divergence_schema() -> Schema:
    props, required = _dataclass_properties(FirstDivergence)
    props["layer"] = _nullable(INT)
    props["kernel"] = kernel_schema()
    return _strict(props, ["layer", "sub_block", "metric", "value", "cause", "why", "switches"])


def summary_schema() -> Schema:
    """One number (or null, with its reason) per declared metric."""
    names = [m.name for m in metric_table.METRICS]
    props: dict[str, Schema] = {name: {**NUMBER, "description": f"{m.doc} ({m.unit})"}
                                for name, m in zip(names, metric_table.METRICS)}
    return _strict(props, names)


def _bounds_schema() -> Schema:
    props = {"bound": STRING, "metric": {"enum": list(metric_table.bound_names())},
             "op": {"enum": [">", ">=", "<", "<="]}, "limit": NUMBER, "value": NUMBER, "broken": BOOL}
    return {"type": "array", "items": _strict(props, ["bound", "metric", "op", "limit", "value", "broken"])}


def _self_test_schema() -> Schema:
    props = {"defect": STRING, "kind": STRING, "summary": STRING, "planted_at": OBJECTS, "named": BOOL,
             "first_divergence": _nullable(first_divergence_schema()), "tensors": OBJECTS,
             "attribution": _nullable(OBJECT)}
    return {"type": "array", "items": _strict(props, list(props))}


def _logits_schema() -> Schema:
    lp = _strict({"mean": NUMBER, "p99": NUMBER, "max": NUMBER}, ["mean", "p99", "max"])
    props = {"logprob_abs_diff": lp, "top1_agreement": NUMBER, "kl": NUMBER, "positions": INT,
             "next_token_positions": INT}
    return _strict(props, list(props))


def _conventions_schema() -> Schema:
    side = {"type": "object", "additionalProperties": STRING}
    return _strict({"serve": side, "train": side}, ["serve", "train"])


# the report's own fields, in the order it writes them, and whether every report has them
def _report_fields() -> list[tuple[str, Schema, bool]]:
    return [
        ("glmconv_version", STRING, True), ("hf_dir", STRING, True), ("mcore_dir", STRING, True),
        ("train_layout", _nullable(STRING), True), ("mode", {"enum": ["propagated", "isolated"]}, True),
        ("dtype", STRING, True), ("device", STRING, True), ("tokens", INT, True), ("stream_layers", BOOL, True),
        ("replay", STRING, True), ("replay_source", _nullable(STRING), True),
        ("kernels", {"enum": ["kernels", "reference"]}, True), ("train_impl", STRINGS, False),
        ("sequences", INT, True), ("seed", INT, True), ("inputs", STRING, True),
        ("train_conventions_base", STRING, True), ("train_convention_overrides", STRINGS, True),
        ("conventions", _conventions_schema(), True), ("threshold", NUMBER, True), ("margin", NUMBER, True),
        ("selection_floor", NUMBER, True), ("noise_measured", BOOL, True), ("weights_checked", BOOL, True),
        ("weight_diffs", OBJECTS, True), ("layers", {"type": "array", "items": record_schema()}, True),
        ("logits", _logits_schema(), True), ("summary", summary_schema(), True),
        ("first_divergence", _nullable(first_divergence_schema()), True),
        ("first_divergence_switches", STRINGS, True), ("attribution", _nullable(OBJECT), True),
        ("indexer_divergence", _nullable(OBJECT), True), ("gate", {"enum": ["verdict", "bounds"]}, True),
        ("bounds", _bounds_schema(), True), ("self_test", _self_test_schema(), False),
        ("self_test_skipped", OBJECTS, False), ("passed", BOOL, True), ("elapsed_s", NUMBER, True),
        # added by the run around the report (glmconv.compare.run_parity, glmconv.api.parity)
        ("serve_rounded_to_bf16", INT, False), ("peak_memory", OBJECT, False), ("wall_s", NUMBER, False),
        ("config_keys_ignored", STRINGS, False), ("report_files", STRINGS, False),
        ("report_skipped", STRINGS, False),
    ]


def report_schema() -> Schema:
    fields = _report_fields()
    out = _strict({name: schema for name, schema, _ in fields}, [name for name, _, always in fields if always])
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "glmconv parity report",
            "description": "report.json of `glmconv parity` (and what glmconv.api.parity returns)", **out}


def schema_text() -> str:
    """The schema as docs/parity-report.schema.json holds it."""
    return json_text(report_schema(), indent=2) + "\n"
