"""The planted-defect catalog: conversion defects and convention slips that parity's verdict must name.

Each defect is planted in memory over the train side's prepared weights (or its conventions) of any converted
pair; `parity --self-test` runs the clean pair and every defect in one pass over the layers (each layer's weights
read once) and says, per defect, whether the verdict names it at the layer and sub-block it was planted in.
Where a defect goes is chosen from the config by layer kind ("the first DSA layer"), so it fits any checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmconv.config import DSA, KDA, MOE, GlmConfig
from glmconv.errors import GlmconvError
from glmconv.models.conventions import ACTS_AT, SELECTION, Conventions

if TYPE_CHECKING:  # torch and the weights at use: `parity --help` lists the catalog without importing torch
    import torch

    from glmconv.models.weights import ExpertBank

Damage = Callable[["torch.Tensor"], "torch.Tensor"]
FP8_BLOCK = 128  # the release's FP8 scale blocks: [128, 128] weights share one scale


@dataclass(frozen=True)
class Defect:
    """One planted defect: a damaged field of one sub-block's weights, or one train switch set to its other value."""

    name: str
    summary: str
    kind: str = "weights"  # "weights" or "convention"
    site: str = ""  # where: "kda", "kda:1" (the second KDA layer), "dsa", "dense", "moe"
    sub_block: str = "attention"
    path: tuple[str, ...] = ()  # the damaged field of the sub-block's weights
    damage: Damage | None = None
    convention: str = ""  # KEY=VALUE for a convention defect


# ---- damages --------------------------------------------------------------------------------------------------

def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat(parts)


def _reverse_first_rows(n_rows: Callable[[torch.Tensor], int]) -> Damage:
    return lambda t: _cat([t[:n_rows(t)].flip(0), t[n_rows(t):]])


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    return _cat(list(t.chunk(2, dim=0)[::-1]))


def _scale_first_block(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[:FP8_BLOCK, :FP8_BLOCK] *= 2
    return out


def _swap_pre_post_rows(t: torch.Tensor) -> torch.Tensor:
    n = int(round((t.shape[0] + 4) ** 0.5)) - 2  # fn has (2 + n) * n rows: pre [0, n), post [n, 2n), comb after
    return _cat([t[n:2 * n], t[:n], t[2 * n:]])


def _zero_first_rows(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out[: max(1, t.shape[0] // 8)] = 0
    return out


CATALOG: tuple[Defect, ...] = (
    Defect("kda-q-rows-permuted", "KDA q_proj: the first head's rows reversed (a row permutation inside a tensor)",
           site="kda", path=("kda", "q_proj"), damage=_reverse_first_rows(lambda t: t.shape[0] // 8 or 1)),
    Defect("experts-swapped", "MoE: experts 0 and 1 swapped (gate, up and down)", site="moe", sub_block="mlp",
           path=("moe", "experts")),
    Defect("fc1-mis-split", "dense MLP linear_fc1 split the wrong way round: gate and up halves swapped",
           site="dense", sub_block="mlp", path=("dense",)),
    Defect("fp8-scale-block", "DSA indexer wk: one 128x128 FP8 scale block off by 2x", site="dsa",
           path=("dsa", "indexer", "wk"), damage=_scale_first_block),
    Defect("norm-offset", "DSA q_a_norm stored as w + 1 (a norm-weight offset convention)", site="dsa",
           path=("dsa", "q_a_norm"), damage=lambda t: t + 1),
    Defect("layers-swapped", "the attention weights of the first two KDA layers swapped", site="kda"),
    Defect("conv-reversed", "KDA short conv weights reversed along the kernel", site="kda:1",
           path=("kda", "conv"), damage=lambda t: t.flip(-1)),
    Defect("decay-sign", "KDA dt_bias with its sign flipped (the decay gate's bias)", site="kda:2",
           path=("kda", "dt_bias"), damage=lambda t: -t),
    Defect("router-bias", "MoE router expert_bias shifted by one expert", site="moe", sub_block="mlp",
           path=("moe", "expert_bias"), damage=lambda t: t.roll(1)),
    Defect("hc-mix-split", "the MLP hyper-connection fn: pre and post rows swapped (a mis-split fused tensor)",
           site="moe", sub_block="mlp", path=("hc", "fn"), damage=_swap_pre_post_rows),
    Defect("shared-rows-zero", "MoE shared expert down_proj: its first eighth of rows left at zero (a shard not "
           "written)", site="moe", sub_block="mlp", path=("moe", "shared", "down"), damage=_zero_first_rows),
    Defect("kv-heads-permuted", "DSA kv_b: the first head's rows reversed", site="dsa", path=("dsa", "kv_b"),
           damage=_reverse_first_rows(lambda t: t.shape[0] // 8 or 1)),
    *(Defect(f"convention-{key}", f"train convention {key}={value} alone", kind="convention",
             convention=f"{key}={value}")
      for key, value in (("proj_rms", "megatron"), ("hc_mix", "bf16"), ("swiglu_clamp", "off"),
                         ("indexer_query", "raw"), ("indexer_kpool", "off"))),
)
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

    def patch(self, sub_block: str, layer: int, w: Any, read: Callable[[int], Any]) -> Any:
        """The model's weight patch (glmconv.models.model.WeightPatch)."""
        if self.defect.kind != "weights" or (layer, sub_block) not in self.sites:
            return w
        if self.defect.name == "layers-swapped":
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
    if defect.name == "layers-swapped":
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
    if d.name == "experts-swapped":
        moe = w.moe
        return dataclasses.replace(w, moe=dataclasses.replace(moe, experts=swapped_experts(moe.experts, 0, 1)))
    if d.name == "fc1-mis-split":
        from glmconv.models.weights import Swiglu

        dense = w.dense
        return dataclasses.replace(w, dense=Swiglu(dense.up, dense.gate, dense.down))
    assert d.damage is not None
    return _replace_path(w, d.path, d.damage)


def _replace_path(obj: Any, path: tuple[str, ...], damage: Damage) -> Any:
    if not path:
        return damage(obj)
    return dataclasses.replace(obj, **{path[0]: _replace_path(getattr(obj, path[0]), path[1:], damage)})


def swapped_experts(bank: ExpertBank, a: int, b: int) -> ExpertBank:
    """`bank` with experts `a` and `b` in each other's places."""
    return _swapped_experts_class()(bank, a, b)


@functools.cache
def _swapped_experts_class() -> type:
    """The ExpertBank subclass, made at first use (its base imports torch)."""
    from glmconv.models.weights import ExpertBank, Swiglu

    class SwappedExperts(ExpertBank):
        """A prepared expert bank with two experts' places exchanged."""

        on_device = True

        def __init__(self, bank: ExpertBank, a: int, b: int) -> None:
            self._bank, self._swap = bank, {a: b, b: a}
            self.num, self.nbytes = bank.num, bank.nbytes

        def get(self, expert: int) -> Swiglu:
            return self._bank.get(self._swap.get(expert, expert))

    return SwappedExperts
