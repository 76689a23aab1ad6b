"""glmconv: move GLM-5.3-Flash between Hugging Face checkpoints and Megatron-core torch_dist, and prove parity.

    import glmconv

    glmconv.convert("hf/", "mcore/")                      # HF (BF16 or FP8) -> torch_dist
    glmconv.export("mcore/", "hf2/", like="hf/")          # torch_dist -> HF, bit-exact for BF16
    assert glmconv.audit("hf2/", against="mcore/")["ok"]  # every tensor, both ways, through the mapping
    assert glmconv.verify("hf/", "mcore/")["equal"]       # every value, bit for bit, through the mapping
    report = glmconv.parity("hf/", "mcore/", fail_on=("logprob_abs_diff.max>1e-4",))
    for name, tensor in glmconv.hf_weights(params, "mcore/config.json"):  # a trainer's (name, tensor) pairs
        ...                                                # -> HF names, export's bytes, bounded memory

Errors a user can cause raise `GlmconvError` (subclasses `ConfigError`, `CheckpointError`) with a one-line
message. `load_config` and `build_plan` give the tensor plan (every tensor on both sides) without reading any.
"""

from __future__ import annotations

from typing import Any

from glmconv.config import GlmConfig
from glmconv.errors import CheckpointError, ConfigError, GlmconvError
from glmconv.io.config_file import load_config
from glmconv.plan import Plan, build_plan
from glmconv.version import __version__

API = ("audit", "convert", "export", "hf_weights", "parity", "relayout", "verify")  # glmconv.api's, on first use

__all__ = ["CheckpointError", "ConfigError", "GlmConfig", "GlmconvError", "Plan", "__version__", "audit",
           "build_plan", "convert", "export", "hf_weights", "load_config", "parity", "relayout", "verify"]


def __getattr__(name: str) -> Any:
    """`glmconv.convert` and the other calls: `glmconv.api` is imported when one is first used (PEP 562), so that
    `python -m glmconv CMD` and `import glmconv.plan` load only the modules they need."""
    if name not in API:
        raise AttributeError(f"module 'glmconv' has no attribute {name!r}")
    from glmconv import api

    return getattr(api, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
