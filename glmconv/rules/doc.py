"""The mapping table as Markdown (docs/mapping.md is this output, checked by a test), so the README can link it."""

from __future__ import annotations

from glmconv.rules.table import BF16, F32, GLOBAL, MTP, RULES, VISION, Rule

HEADER = """# The mapping table

Generated from `glmconv/rules/table.py` by `python -m glmconv.rules.doc > docs/mapping.md`; a test keeps it
current. Templates: `{text}` the HF text prefix (`model.language_model.`), `{layer}` a layer's prefix on either
side (`model.language_model.layers.N.` / `decoder.layers.N.`), `{mtp}` the Megatron MTP layer
(`mtp.layers.0.transformer_layer.`), `{visual}` the HF vision prefix, `{e}` an expert, `{b}` a vision block.
Shapes are named dimensions resolved from the config. dtype: what the release stores and Megatron receives
(FP8 weights are dequantised to BF16; `export --fp8` re-quantises them).

| HF | Megatron | transform | shape (HF) | applies to | dtype |
|---|---|---|---|---|---|
"""


def _where(rule: Rule) -> str:
    if rule.scope in (GLOBAL, MTP, VISION):
        return {GLOBAL: "model", MTP: "MTP layer", VISION: "vision tower"}[rule.scope]
    parts = [f"{rule.attn} layers" if rule.attn else "", f"{rule.mlp} MLP" if rule.mlp else "",
             "own indexer" if rule.indexer else "", "hc layers" if rule.hc else ""]
    return ", ".join(p for p in parts if p) or "every layer"


def _dtype(rule: Rule) -> str:
    return F32 if rule.keep_f32 else f"FP8 -> {BF16}" if rule.fp8 else BF16


def _row(rule: Rule) -> str:
    cells = ["<br>".join(f"`{t}`" for t in rule.hf), "<br>".join(f"`{t}`" for t in rule.mcore),
             repr(rule.transform), "<br>".join(f"[{', '.join(map(str, s))}]" for s in rule.shapes),
             _where(rule), _dtype(rule)]
    return "| " + " | ".join(cells) + " |"


def render() -> str:
    return HEADER + "\n".join(_row(r) for r in RULES) + "\n"


if __name__ == "__main__":
    print(render(), end="")
