"""Which Megatron layout a torch_dist checkpoint has: what convert recorded, checked against its key names."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from glmconv.config import GlmConfig
from glmconv.defaults import DEFAULT_LAYOUT, LAYOUT_CHOICES
from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import optional_file
from glmconv.io.file_names import MANIFEST_NAME
from glmconv.io.jsonfile import load_json_file
from glmconv.io.torch_dist.metadata import inspect_torch_dist, is_torch_dist
from glmconv.plan import Plan, detect_layout
from glmconv.rules import layouts, names
from glmconv.rules import roles as R
from glmconv.rules.layouts import MTP_PART, VISION_PART
from glmconv.text import count

LAYOUT_KEY = "layout"  # in glmconv.json and in the common state's `glmconv` entry


def recorded_layout(root: Path) -> str | None:
    """The layout glmconv.json records; None without a manifest or a record (an older glmconv's checkpoint)."""
    path = optional_file(root, MANIFEST_NAME)
    data = load_json_file(path, source=str(root / MANIFEST_NAME)) if path is not None else None
    value = data.get(LAYOUT_KEY) if isinstance(data, dict) else None
    if value is None:
        return None
    if value not in LAYOUT_CHOICES:
        raise CheckpointError(f"{root / MANIFEST_NAME}: layout {value!r} is not one of {', '.join(LAYOUT_CHOICES)}")
    return str(value)


def checkpoint_layout(root: Path, config: GlmConfig, keys: Iterable[str], asked: str | None = None) -> str:
    """The layout to read `root` in: `asked` (--layout), else the record, else what the names say.

    Any two of them that disagree are refused, naming both: reading a checkpoint in the wrong layout finds
    nothing, or worse, half of it.
    """
    found = detect_layout(config, set(keys))
    recorded = recorded_layout(root)
    for what, value in ((f"--layout {asked}", asked), (f"{MANIFEST_NAME} records the {recorded} layout", recorded)):
        if value is not None and found is not None and value != found:
            raise CheckpointError(f"{root}: {what}, but its tensors are named in the {found} layout")
    return asked or recorded or found or DEFAULT_LAYOUT


def trained_layout(path: Path, config: GlmConfig, asked: str | None = None) -> str:
    """The layout a training run of `path` uses: a torch_dist checkpoint's own (`checkpoint_layout`, `asked`
    checked against it), else `asked`, else the default (a config.json or an HF checkpoint has no layout)."""
    if not is_torch_dist(Path(path)):
        return asked or DEFAULT_LAYOUT
    return checkpoint_layout(Path(path), config, inspect_torch_dist(path).tensors, asked)


def homeless_counts(plan: Plan) -> dict[str, int]:
    """HF tensors (FP8 scales aside) the plan's layout has no home for, per part ("mtp", "vision") or per role."""
    out: dict[str, int] = {}
    for m in plan.homeless():
        part = m.optional_part(plan.config.num_layers)
        kind = part if part in (MTP_PART, VISION_PART) else m.rule.role
        out[kind] = out.get(kind, 0) + len(m.hf)
    return out


def homeless_line(plan: Plan) -> str | None:
    """One line saying what the layout's trainer will not load and where it is kept; None when all has a home."""
    counts = homeless_counts(plan)
    if not counts:
        return None
    what = ", ".join(f"{KIND_WORDS.get(kind, kind)} ({count(n, 'tensor')})" for kind, n in counts.items())
    return (f"warning: the {plan.layout} layout has no parameter for {what}: kept under {names.KEPT_PREFIX} in a "
            f"sidecar beside the DCP so that export restores them; {layouts.layout(plan.layout).trainer} does not "
            "load them")


KIND_WORDS = {MTP_PART: "the MTP layer", VISION_PART: "the vision tower",
              R.INDEXER_COMPRESS_GATE: "the kpool compress_gate", R.INDEXER_COMPRESS_APE: "the kpool compress_ape"}
