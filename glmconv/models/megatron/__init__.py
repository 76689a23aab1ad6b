"""`--train-backend megatron`: parity's train side on megatron-core's own DSA attention and MoE modules, built from
the config as a trainer builds them (build), loaded from the converted mcore-layout checkpoint through megatron-core's
`dist_checkpointing` (load), run between glmconv's own KDA, mHC, norms, embedding and head (model)."""

from __future__ import annotations

from glmconv.models.megatron.load import MegatronModules, load_modules
from glmconv.models.megatron.model import MegatronModel, megatron_model

__all__ = ["MegatronModel", "MegatronModules", "load_modules", "megatron_model"]
