"""The mapping table as Markdown (docs/mapping.md is this output, checked by a test), so the README can link it."""

from __future__ import annotations

from glmconv.defaults import DTYPE_CHOICES, MCORE, MILES
from glmconv.rules.layouts import LAYOUTS
from glmconv.rules.names import KEPT_PREFIX
from glmconv.rules.table import FP8, GLOBAL, MTP, POLICIES, RULES, VISION, DtypePolicy, Rule

HEADER = """# The mapping table

Generated from `glmconv/rules/table.py` by `python -m glmconv.rules.doc > docs/mapping.md`; a test keeps it
current. Templates: `{text}` the HF text prefix (`model.language_model.`), `{layer}` a layer's prefix on either
side (`model.language_model.layers.N.` / `decoder.layers.N.`), `{mtp}` the Megatron MTP layer
(`mtp.layers.0.transformer_layer.`), `{visual}` the HF vision prefix, `{e}` an expert, `{b}` a vision block.
Shapes are named dimensions resolved from the config. dtype: the rule's dtype policy, below.

Megatron names are the `miles` layout's (the default); the `mcore` column gives megatron-core's native names
(`convert --layout mcore`, as Megatron-Bridge names them) where they differ. What the mcore layout has no
parameter for is kept under `KEPT` (never loaded by its trainer; export restores it): the rules marked so, and
in that layout also every PARTS tensor. Kept tensors are stored in a sidecar beside the DCP (README: the layouts),
so that megatron-core's strictest load (`raise_all`) finds exactly what the trainer requests.

**TE extra state**: the layouts whose trainer builds the tensor's module from Transformer Engine (a linear, or a
`TENorm`), which saves an `_extra_state` object (`torch.empty(0, dtype=torch.uint8)` without FP8) that a trainer
requests at load: convert and relayout write one per module (one per expert for the grouped experts). A norm fused
into a TE linear (`linear_fc1.layer_norm_weight`, miles' `linear_{q,kv}_up_proj.layer_norm_weight`) is the linear's.

| HF | Megatron | mcore layout | transform | shape (HF) | applies to | dtype | TE extra state |
|---|---|---|---|---|---|---|---|
""".replace("KEPT", KEPT_PREFIX).replace("PARTS", " and every ".join(sorted(LAYOUTS[MCORE].homeless_parts)))

POLICY_HEADER = """
## Dtype policies

Every rule has one. **release**: what the GLM-5.3-Flash release stores. **accepted**: what `convert` takes from
any checkpoint (transformers' own `save_pretrained` keeps modules matching `conv1d` in F32 in a BF16 save, and a
full-F32 save stores everything F32); rules marked `FP8` also take the release's F8_E4M3 weights with their
`_scale_inv` blocks (then every FP8-eligible weight must be FP8), dequantised to BF16 as the serving stacks do.
**Megatron**: the dtype `convert --dtype keep|bf16|fp32` gives it (`keep`, the default: as stored, so a BF16
release stays BF16, an F32 conv1d stays F32 and the round trip is bit-exact; HF tensors of one mapping stored in
different dtypes meet in F32). `--dtype bf16` rounds F32 weights to BF16: the summary counts them
(`narrowed_f32_to_bf16`), it is never silent. **export writes**: each HF tensor in the dtype the source stored
(recorded by convert in `glmconv.json`, or `--like`'s where given); for a checkpoint converted by an older
glmconv, which has no record, this column.

| policy | release | accepted | Megatron: CHOICES | export writes |
|---|---|---|---|---|
""".replace("CHOICES", " / ".join(f"`--dtype {c}`" for c in DTYPE_CHOICES))


def _where(rule: Rule) -> str:
    if rule.scope in (GLOBAL, MTP, VISION):
        return {GLOBAL: "model", MTP: "MTP layer", VISION: "vision tower"}[rule.scope]
    parts = [f"{rule.attn} layers" if rule.attn else "", f"{rule.mlp} MLP" if rule.mlp else "",
             "own indexer" if rule.indexer else "", "hc layers" if rule.hc else ""]
    return ", ".join(p for p in parts if p) or "every layer"


def _dtype(rule: Rule) -> str:
    return f"`{rule.dtypes.name}`" + (f", {FP8} in the FP8 release" if rule.fp8 else "")


def _mcore(rule: Rule) -> str:
    """The rule in the mcore layout: its names (and transform) where they differ from miles', or that it is kept."""
    native = rule.in_layout(MCORE)
    if native is rule:
        return "same"
    names = "<br>".join(f"`{t}`" for t in native.mcore)
    if native.homeless:
        return f"no parameter: kept as `{KEPT_PREFIX}`+{names}"
    return names + ("" if native.transform == rule.transform else f" ({native.transform!r})")


def _extra_state(rule: Rule) -> str:
    """The layouts in which the rule's module saves an `_extra_state` object."""
    return ", ".join(name for name in (MILES, MCORE) if rule.in_layout(name).extra_state) or "-"


def _row(rule: Rule) -> str:
    cells = ["<br>".join(f"`{t}`" for t in rule.hf), "<br>".join(f"`{t}`" for t in rule.mcore), _mcore(rule),
             repr(rule.transform), "<br>".join(f"[{', '.join(map(str, s))}]" for s in rule.shapes),
             _where(rule), _dtype(rule), _extra_state(rule)]
    return "| " + " | ".join(cells) + " |"


def _policy_row(p: DtypePolicy) -> str:
    megatron = " / ".join(want for _, want in p.megatron)
    cells = [f"**{p.name}**", p.release, ", ".join(p.accepted), megatron,
             p.export_default]
    return "| " + " | ".join(cells) + " |"


def render() -> str:
    return (HEADER + "\n".join(_row(r) for r in RULES) + "\n" + POLICY_HEADER
            + "\n".join(_policy_row(p) for p in POLICIES) + "\n")


if __name__ == "__main__":
    print(render(), end="")
