"""The Megatron layouts glmconv reads and writes: which trainer loads each, and what it has no module for.

A layout is data: the rules table says, per rule, where each layout keeps the tensors (`table.Home`); this
module says which whole parts a layout's trainer has no module for. Tensors without a home are still written,
under `names.KEPT_PREFIX`, so that export restores them; no trainer loads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmconv.defaults import LAYOUT_CHOICES, MCORE, MILES
from glmconv.errors import GlmconvError

MTP_PART, VISION_PART = "mtp", "vision"


@dataclass(frozen=True)
class MegatronLayout:
    """One trainer's naming of the model: who loads it and which optional parts it has no module for."""

    name: str
    trainer: str
    homeless_parts: frozenset[str]  # "mtp" / "vision": their tensors are kept, not loaded


LAYOUTS: dict[str, MegatronLayout] = {
    MILES: MegatronLayout(MILES, "miles (its glm5_next plugin: its own KDA, DSA and mHC modules on megatron-core)",
                          frozenset()),
    MCORE: MegatronLayout(MCORE, "a trainer built by Megatron-Bridge or NeMo on megatron-core's native modules",
                          frozenset({MTP_PART, VISION_PART})),
}
assert tuple(LAYOUTS) == LAYOUT_CHOICES, "glmconv.defaults.LAYOUT_CHOICES names every layout, in order"


def layout(name: str) -> MegatronLayout:
    """The layout called `name`; one line naming the choices otherwise."""

    if name not in LAYOUTS:
        raise GlmconvError(f"unknown Megatron layout {name!r}: choose {' or '.join(LAYOUT_CHOICES)}")
    return LAYOUTS[name]
