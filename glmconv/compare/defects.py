"""Planting the catalog's defects (glmconv.compare.catalog) over the train side's prepared weights, conventions
or kernel path (glmconv.compare.kernel_defects).

`parity --self-test` runs the clean pair and every defect in one pass over the layers (each layer's weights read
once) and says, per defect, whether the verdict names it at the layer and sub-block it was planted in. Where a
defect goes is chosen from the config by layer kind ("the first DSA layer"), so it fits any checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmconv.compare.catalog import Defect
from glmconv.compare.kernel_defects import damaged
from glmconv.config import DSA, KDA, MOE, GlmConfig
from glmconv.kernels import OpSet
from glmconv.models.conventions import ACTS_AT, SELECTION, Conventions
from glmconv.models.weights import ExpertBank, Swiglu

if TYPE_CHECKING:
    import torch


Damage = Callable[["torch.Tensor"], "torch.Tensor"]
FP8_BLOCK = 128  # the release's FP8 scale blocks: [128, 128] weights share one scale


def _eighth(t: torch.Tensor) -> int:
    return max(1, t.shape[0] // 8)


def _reverse_first_eighth(t: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.cat([t[:_eighth(t)].flip(0), t[_eighth(t):]])


def _double_first_block(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[:FP8_BLOCK, :FP8_BLOCK] *= 2
    return out


def _swap_pre_post_rows(t: torch.Tensor) -> torch.Tensor:
    import torch

    n = int(round((t.shape[0] + 4) ** 0.5)) - 2  # fn has (2 + n) * n rows: pre [0, n), post [n, 2n), comb after
    return torch.cat([t[n:2 * n], t[:n], t[2 * n:]])


def _zero_first_eighth(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[:_eighth(t)] = 0
    return out


DAMAGES: dict[str, Damage] = {
    "reverse-first-eighth": _reverse_first_eighth, "double-first-block": _double_first_block,
    "plus-one": lambda t: t + 1, "flip-last-dim": lambda t: t.flip(-1), "negate": lambda t: -t,
    "roll-one": lambda t: t.roll(1), "swap-pre-post-rows": _swap_pre_post_rows, "zero-first-eighth": _zero_first_eighth,
}


# ---- placing a defect on a config ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planted:
    """A defect placed on a model: the layers and sub-blocks it damages, or the conventions it runs."""

    defect: Defect
    sites: tuple[tuple[int, str], ...]  # (layer, sub_block) it changes; conventions: where the switch acts
    conventions: Conventions | None = None

    @property
    def name(self) -> str:
        return self.defect.name

    def ops(self, base: OpSet) -> OpSet:
        """The kernel path `base` with this kernel defect's op damaged (its reference untouched)."""
        return base.with_op(self.defect.op, damaged(self.defect.damage, getattr(base, self.defect.op)))

    def patch(self, sub_block: str, layer: int, w: Any, read: Callable[[int], Any]) -> Any:
        """The model's weight patch (glmconv.models.model.WeightPatch)."""
        if self.defect.kind != "weights" or (layer, sub_block) not in self.sites:
            return w
        if self.defect.damage == "swap-layers":
            (a, _), (b, _) = self.sites
            return read(b if layer == a else a)
        return _damage(w, self.defect)


def plant(defect: Defect, config: GlmConfig, train: Conventions) -> Planted | None:
    """`defect` placed on `config`; None where it does not apply (no such layer, or the switch is already on)."""
    if defect.kind == "convention":
        key, value = defect.convention.split("=")
        if getattr(train, key) == value:
            return None
        conv = train.with_overrides([defect.convention])
        return Planted(defect, _acting_sites(key, config), conv)
    layers = _layers(defect.site, config)
    if defect.kind == "kernel":
        return Planted(defect, ((layers[0], "attention"),)) if layers else None
    if defect.damage == "swap-layers":
        kda = _layers("kda", config, every=True)
        return Planted(defect, ((kda[0], "attention"), (kda[1], "attention"))) if len(kda) > 1 else None
    return Planted(defect, ((layers[0], defect.sub_block),)) if layers else None


def _layers(site: str, config: GlmConfig, every: bool = False) -> list[int]:
    kind, _, nth = site.partition(":")
    types = config.mlp_types if kind in ("dense", MOE) else config.attn_types
    want = {"kda": KDA, "dsa": DSA, "moe": MOE}.get(kind)
    found = [i for i, t in enumerate(types) if (t == want if want else t != MOE)]
    if kind == "dsa" and config.indexer_full:
        found = [i for i in found if config.indexer_full[i]]
    if every or not found:
        return found
    return [found[min(int(nth or 0), len(found) - 1)]]


def _acting_sites(key: str, config: GlmConfig) -> tuple[tuple[int, str], ...]:
    """The sub-blocks a switch acts at (a selection switch: the DSA attention sub-blocks)."""
    sites = []
    for layer in range(config.num_layers):
        for sub in ("attention", "mlp"):
            acts = sub in ACTS_AT[key] or (SELECTION in ACTS_AT[key] and sub == "attention"
                                           and config.attn_types[layer] == DSA)
            if acts:
                sites.append((layer, sub))
    return tuple(sites)


def _damage(w: Any, d: Defect) -> Any:
    """A copy of the sub-block weights `w` with `d`'s field damaged (the rest shared, never modified)."""
    if d.damage == "swap-experts-0-1":
        moe = w.moe
        return dataclasses.replace(w, moe=dataclasses.replace(moe, experts=SwappedExperts(moe.experts, 0, 1)))
    if d.damage == "swap-gate-up":
        dense = w.dense
        return dataclasses.replace(w, dense=Swiglu(dense.up, dense.gate, dense.down))
    return _replace_path(w, d.path, DAMAGES[d.damage])


def _replace_path(obj: Any, path: tuple[str, ...], damage: Damage) -> Any:
    if not path:
        return damage(obj)
    return dataclasses.replace(obj, **{path[0]: _replace_path(getattr(obj, path[0]), path[1:], damage)})


class SwappedExperts(ExpertBank):
    """A prepared expert bank with two experts' places exchanged."""

    on_device = True

    def __init__(self, bank: ExpertBank, a: int, b: int) -> None:
        self._bank, self._swap = bank, {a: b, b: a}
        self.num, self.nbytes = bank.num, bank.nbytes

    def get(self, expert: int) -> Swiglu:
        return self._bank.get(self._swap.get(expert, expert))
