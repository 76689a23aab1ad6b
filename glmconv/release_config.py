"""The release's FP8 `quantization_config` block: what `export --fp8` publishes and the FP8 fixtures reproduce."""

from __future__ import annotations

from typing import Any

from glmconv.config import parse_config
from glmconv.plan import build_plan
from glmconv.rules.names import HF_FLAT_PREFIX


def quantization_config(modules_to_not_convert: list[str]) -> dict[str, Any]:
    """The release's FP8 quantization_config block."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": list(modules_to_not_convert)}


def modules_not_converted(config: dict[str, Any]) -> list[str]:
    """Non-FP8 modules owning a matrix, under the flat `model.` prefix, like the release's list.

    The release writes this list against the wrong (flat) prefix; glmconv trusts `_scale_inv` instead, and
    the fixture keeps the quirk so that readers relying on the list are caught.
    """
    plan = build_plan(parse_config(config), fp8=True, vision=False, text_prefix=HF_FLAT_PREFIX)
    return sorted({t.name.rsplit(".", 1)[0] for m in plan.mappings if not m.rule.fp8 for t in m.hf
                   if len(t.shape) >= 2 and t.name.endswith(".weight")})
