"""The planted-defect catalog, as data: conversion defects and convention slips that parity's verdict must name.

Each entry says what is damaged and where (by layer kind, so it fits any checkpoint), and names its damage, which
glmconv.compare.defects implements over the train side's prepared weights. Kept free of torch: the CLI lists it.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmconv.errors import GlmconvError


@dataclass(frozen=True)
class Defect:
    """One planted defect: a damaged field of one sub-block's weights, or one train switch set to its other value."""

    name: str
    summary: str
    kind: str = "weights"  # "weights" or "convention"
    site: str = ""  # where: "kda", "kda:1" (the second KDA layer), "dsa", "dense", "moe"
    sub_block: str = "attention"
    path: tuple[str, ...] = ()  # the damaged field of the sub-block's weights
    damage: str = ""  # the name of its damage in glmconv.compare.defects.DAMAGES
    convention: str = ""  # KEY=VALUE for a convention defect


CATALOG: tuple[Defect, ...] = (
    Defect("kda-q-rows-permuted", "KDA q_proj: the first head's rows reversed (a row permutation inside a tensor)",
           site="kda", path=("kda", "q_proj"), damage="reverse-first-eighth"),
    Defect("experts-swapped", "MoE: experts 0 and 1 swapped (gate, up and down)", site="moe", sub_block="mlp",
           path=("moe", "experts"), damage="swap-experts-0-1"),
    Defect("fc1-mis-split", "dense MLP linear_fc1 split the wrong way round: gate and up halves swapped",
           site="dense", sub_block="mlp", path=("dense",), damage="swap-gate-up"),
    Defect("fp8-scale-block", "DSA indexer wk: one 128x128 FP8 scale block off by 2x", site="dsa",
           path=("dsa", "indexer", "wk"), damage="double-first-block"),
    Defect("norm-offset", "DSA q_a_norm stored as w + 1 (a norm-weight offset convention)", site="dsa",
           path=("dsa", "q_a_norm"), damage="plus-one"),
    Defect("layers-swapped", "the attention weights of the first two KDA layers swapped", site="kda",
           damage="swap-layers"),
    Defect("conv-reversed", "KDA short conv weights reversed along the kernel", site="kda:1",
           path=("kda", "conv"), damage="flip-last-dim"),
    Defect("decay-sign", "KDA dt_bias with its sign flipped (the decay gate's bias)", site="kda:2",
           path=("kda", "dt_bias"), damage="negate"),
    Defect("router-bias", "MoE router expert_bias shifted by one expert", site="moe", sub_block="mlp",
           path=("moe", "expert_bias"), damage="roll-one"),
    Defect("hc-mix-split", "the MLP hyper-connection fn: pre and post rows swapped (a mis-split fused tensor)",
           site="moe", sub_block="mlp", path=("hc", "fn"), damage="swap-pre-post-rows"),
    Defect("shared-rows-zero", "MoE shared expert down_proj: its first eighth of rows left at zero (a shard not "
           "written)", site="moe", sub_block="mlp", path=("moe", "shared", "down"), damage="zero-first-eighth"),
    Defect("kv-heads-permuted", "DSA kv_b: the first head's rows reversed", site="dsa", path=("dsa", "kv_b"),
           damage="reverse-first-eighth"),
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
