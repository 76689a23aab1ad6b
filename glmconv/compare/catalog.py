"""The planted-defect catalog: conversion defects and convention slips that parity's verdict must name.

The definitions are data, `fixtures/defects.json` (installed as `glmconv_fixtures`), checked here on load. Each
entry says what is damaged and where (by layer kind, so it fits any checkpoint), and names its damage, which
glmconv.compare.defects implements over the train side's prepared weights. Kept free of torch: the CLI lists it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from glmconv.compare.kernel_defects import KERNEL_DAMAGES
from glmconv.data_files import DEFECTS_FILE, read_text
from glmconv.errors import GlmconvError
from glmconv.kernels import OpSet


@dataclass(frozen=True)
class Defect:
    """One planted defect: a damaged field of one sub-block's weights, one train switch set to its other value, or
    one kernel call of the train side's kernel path given a wrong argument or handing back a wrong result."""

    name: str
    summary: str
    kind: str = "weights"  # "weights", "convention" or "kernel"
    site: str = ""  # where: "kda", "kda:1" (the second KDA layer), "dsa", "dense", "moe"
    sub_block: str = "attention"
    path: tuple[str, ...] = ()  # the damaged field of the sub-block's weights
    damage: str = ""  # its damage: glmconv.compare.defects.DAMAGES, or kernel_defects.KERNEL_DAMAGES (kernel)
    convention: str = ""  # KEY=VALUE for a convention defect
    op: str = ""  # the kernel op a kernel defect damages (glmconv.kernels.OpSet.OPS)


class CatalogError(GlmconvError):
    """The defect catalog's data file does not say what a Defect needs (a key unknown, missing or mistyped)."""


# the keys each kind of entry must have, with their JSON types (every key is required: the file says it all)
FIELDS: dict[str, dict[str, type]] = {
    "weights": {"name": str, "kind": str, "site": str, "sub_block": str, "path": list, "damage": str,
                "summary": str},
    "convention": {"name": str, "kind": str, "convention": str, "summary": str},
    "kernel": {"name": str, "kind": str, "site": str, "op": str, "damage": str, "summary": str},
}
_KERNEL_SITES = ("kda", "dsa")  # the layer kinds whose attention runs kernels
_SITE = re.compile(r"(kda|dsa|dense|moe)(:\d+)?")
_SUB_BLOCKS = ("attention", "mlp")


def parse_catalog(text: str, source: str = DEFECTS_FILE) -> tuple[Defect, ...]:
    """The Defects a catalog file defines, in its order; a CatalogError naming the entry and key that is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CatalogError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or set(data) != {"defects"} or not isinstance(data["defects"], list):
        raise CatalogError(f'{source}: expected an object with one key, "defects": a list of entries')
    defects = tuple(_defect(entry, f"{source}: entry {i}") for i, entry in enumerate(data["defects"]))
    names = [d.name for d in defects]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CatalogError(f"{source}: defect names given twice: {', '.join(twice)}")
    return defects


def _defect(entry: Any, where: str) -> Defect:
    """One entry checked against FIELDS for its kind, then its values (site, sub-block, KEY=VALUE)."""
    if not isinstance(entry, dict):
        raise CatalogError(f"{where}: expected an object, got {type(entry).__name__}")
    where = f"{where} ({entry['name']})" if isinstance(entry.get("name"), str) else where
    kind = entry.get("kind")
    if kind not in FIELDS:
        raise CatalogError(f"{where}: kind must be one of {', '.join(FIELDS)}, not {kind!r}")
    _check_keys(entry, FIELDS[kind], where)
    if kind == "convention":
        if not re.fullmatch(r"\w+=\w+", entry["convention"]):
            raise CatalogError(f"{where}: convention must be KEY=VALUE, not {entry['convention']!r}")
        return Defect(**entry)
    if kind == "kernel":
        return _kernel_defect(entry, where)
    if not _SITE.fullmatch(entry["site"]) or entry["sub_block"] not in _SUB_BLOCKS:
        raise CatalogError(f"{where}: site must be kda, dsa, dense or moe (optionally :N) and sub_block "
                           f"{' or '.join(_SUB_BLOCKS)}, not {entry['site']!r} / {entry['sub_block']!r}")
    if not all(isinstance(p, str) for p in entry["path"]):
        raise CatalogError(f"{where}: path must be a list of strings")
    return Defect(**{**entry, "path": tuple(entry["path"])})


def _kernel_defect(entry: dict[str, Any], where: str) -> Defect:
    """A kernel defect: an op of the kernel path, at a KDA or DSA attention sub-block."""
    if entry["op"] not in OpSet.OPS:
        raise CatalogError(f"{where}: op must be one of {', '.join(OpSet.OPS)}, not {entry['op']!r}")
    if entry["damage"] not in KERNEL_DAMAGES:
        raise CatalogError(f"{where}: damage must be one of {', '.join(KERNEL_DAMAGES)}, not {entry['damage']!r}")
    if entry["site"].partition(":")[0] not in _KERNEL_SITES or not _SITE.fullmatch(entry["site"]):
        raise CatalogError(f"{where}: a kernel defect's site must be kda or dsa (optionally :N), not "
                           f"{entry['site']!r}")
    return Defect(**entry)


def _check_keys(entry: dict[str, Any], fields: dict[str, type], where: str) -> None:
    """Exactly the kind's keys, each of its JSON type: a typo is an error, never a silently defaulted field."""
    has = f"(a {entry['kind']} entry has {', '.join(fields)})"
    unknown, missing = sorted(set(entry) - set(fields)), [k for k in fields if k not in entry]
    if unknown:
        raise CatalogError(f"{where}: unknown key(s) {', '.join(unknown)} {has}")
    if missing:
        raise CatalogError(f"{where}: missing key(s) {', '.join(missing)} {has}")
    for key, want in fields.items():
        if not isinstance(entry[key], want) or (want is str and not entry[key]):
            raise CatalogError(f"{where}: {key} must be {'a non-empty string' if want is str else 'a list'}, "
                               f"not {entry[key]!r}")


CATALOG: tuple[Defect, ...] = parse_catalog(read_text(DEFECTS_FILE))
NAMES = tuple(d.name for d in CATALOG)


def select(names: str | None) -> list[Defect]:
    """The catalog, or the comma-separated `names` of it (refused with the known names when one is not)."""
    if not names or names == "all":
        return list(CATALOG)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in NAMES]
    if unknown:
        raise GlmconvError(f"--defects: unknown {', '.join(unknown)} (the catalog: {', '.join(NAMES)})")
    return [d for d in CATALOG if d.name in wanted]
