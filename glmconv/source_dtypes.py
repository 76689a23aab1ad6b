"""The dtypes the HF source stored, recorded by convert in glmconv.json so that export writes each tensor back
in the dtype it came in, without `--like`.

Compact, because glmconv reads at most 64 KiB of a manifest: per rule of the table (keyed by its Megatron
template) the dtype most of its tensors were stored in, plus the tensors that differ from it (none, for the
release and for what transformers' save_pretrained writes). FP8 weights are left out: `export --fp8` decides them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.file_names import MANIFEST_NAME
from glmconv.plan import FP8, Plan
from glmconv.rules import names
from glmconv.rules.table import RULES, Rule

KEY = "hf_dtypes"


def record(plan: Plan) -> dict[str, Any]:
    """`{"defaults": {rule: dtype}, "exceptions": {HF tensor: dtype}}` from a convert plan's stored dtypes."""
    counts: dict[str, Counter[str]] = {}
    for m in plan.mappings:
        for d in m.stored:
            if d is not None and d != FP8:
                counts.setdefault(rule_key(m.rule), Counter())[d] += 1
    defaults = {k: max(sorted(c), key=c.__getitem__) for k, c in counts.items()}
    exceptions = {t.name: d for m in plan.mappings for t, d in zip(m.hf, m.stored)
                  if d is not None and d != FP8 and d != defaults[rule_key(m.rule)]}
    return {"defaults": dict(sorted(defaults.items())), "exceptions": dict(sorted(exceptions.items()))}


def restore(plan: Plan, rec: Any, source_prefix: str, ckpt: Path) -> dict[str, str]:
    """HF tensor of an export plan -> the dtype the source stored it in (where the record covers it).

    `source_prefix`: the source's HF text prefix, the one the record's names use. A record that is not what
    convert writes, or that gives a tensor a dtype its rule does not accept, is refused.
    """
    where = ckpt / MANIFEST_NAME
    defaults, exceptions = _parts(rec, where)
    out: dict[str, str] = {}
    seen: set[str] = set()
    for m in plan.mappings:
        for t in m.hf:
            if t.dtype == FP8:
                continue
            src_name = names.swap_text_prefix(t.name, source_prefix) or t.name
            seen.add(src_name)
            want = exceptions.get(src_name, defaults.get(rule_key(m.rule)))
            if want is None:
                continue
            if not isinstance(want, str) or not t.accepts(want):
                raise CheckpointError(f"{where}: {KEY} gives {src_name} the dtype {want!r}; expected "
                                      f"{t.expected_dtypes()}")
            out[t.name] = want
    unknown = sorted(set(exceptions) - seen)
    if unknown:
        raise CheckpointError(f"{where}: {KEY} lists {unknown[0]}, which is not in the export plan")
    return out


def rule_key(rule: Rule) -> str:
    """A rule's name in the record, whatever the layout: its first miles Megatron template (unique in the table)."""
    return rule.key


def _parts(rec: Any, where: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    ok = isinstance(rec, dict) and isinstance(rec.get("defaults"), dict) and isinstance(rec.get("exceptions"), dict)
    if not ok:
        raise CheckpointError(f"{where}: {KEY} is not what convert writes (an object with defaults and exceptions)")
    keys = {rule_key(r) for r in RULES}
    stray = sorted(k for k in rec["defaults"] if k not in keys)
    if stray:
        raise CheckpointError(f"{where}: {KEY} has a default for {stray[0]!r}, which is no rule of the mapping table")
    return rec["defaults"], rec["exceptions"]
