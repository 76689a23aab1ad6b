"""The megatron-core modules a trainer on the mcore layout builds for a layer's sub-blocks: their state-dict
prefixes (what `sharded_state_dict(prefix=...)` is given), spelled here because only the rules spell names."""

from __future__ import annotations

from glmconv.rules.names import mcore_layer

ATTENTION_MODULE, MLP_MODULE = "self_attention.", "mlp."  # TransformerLayer's attribute names


def attention_prefix(layer: int) -> str:
    """A decoder layer's attention module (AbsorbedMLASelfAttention on a DSA layer)."""
    return mcore_layer(layer) + ATTENTION_MODULE


def mlp_prefix(layer: int) -> str:
    """A decoder layer's MLP module (MoELayer on a MoE layer)."""
    return mcore_layer(layer) + MLP_MODULE
