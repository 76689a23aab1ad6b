"""GLM-5.3-Flash config: unwrap, validate, derive the per-layer schedule, cut to the first N layers."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmconv.errors import ConfigError

TEXT_MODEL_TYPES = ("glm5_next_text",)
WRAPPER_MODEL_TYPES = ("glm5_next",)
KDA, DSA = "kda", "dsa"
DENSE, MOE = "dense", "moe"
_ATTN_NAMES = {
    "linear_attention": KDA,
    "deepseek_sparse_attention": DSA,
    "indexed_attention": DSA,
    "full_attention": DSA,
}
_MLP_NAMES = {"dense": DENSE, "sparse": MOE, "moe": MOE}
# transformers' Glm5NextTextConfig class defaults, used where a config omits a key (as transformers does).
_TEXT_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_attention_heads": 64,
    "n_shared_experts": 1, "n_routed_experts": 288, "num_experts_per_tok": 8, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 16,
    "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "hc_mult": 4,
    "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
}
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "patch_size": 14,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 1536,
    "projection_intermediate_size": 10240, "in_channels": 3,
}


@dataclass(frozen=True)
class VisionDims:
    """Sizes of the vision tower, enough to name and shape its tensors."""

    depth: int
    hidden: int
    intermediate: int
    heads: int
    patch: int
    temporal_patch: int
    merge: int
    out_hidden: int
    proj_intermediate: int
    in_channels: int


@dataclass(frozen=True)
class GlmConfig:
    """A validated GLM-5.3-Flash text config plus its layer schedule and optional vision tower."""

    text: dict[str, Any]
    attn_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    vision: VisionDims | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    nested: bool = True
    indexer_full: tuple[bool, ...] = ()  # per layer: runs its own indexer (has indexer tensors)

    @property
    def num_layers(self) -> int:
        return len(self.attn_types)

    @property
    def num_mtp_layers(self) -> int:
        return int(self.text.get("num_nextn_predict_layers") or 0)

    @property
    def mtp_layer_index(self) -> int:
        """HF stores the MTP layer right after the decoder layers (index 45 in the release)."""
        return self.num_layers

    def dim(self, key: str) -> Any:
        return self.text[key]

    def cut(self, n_layers: int) -> GlmConfig:
        """The first `n_layers` decoder layers, the way the 8-layer training cut is made."""
        if not 1 <= n_layers <= self.num_layers:
            raise ConfigError(f"--layers {n_layers}: must be between 1 and {self.num_layers}")
        raw = copy.deepcopy(self.raw)
        text = raw["text_config"] if self.nested else raw
        text["num_hidden_layers"] = n_layers
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            if isinstance(text.get(key), list):
                text[key] = text[key][:n_layers]
        lac = text.get("linear_attn_config")
        if isinstance(lac, dict):
            for key in ("kda_layers", "full_attn_layers"):
                if isinstance(lac.get(key), list):
                    lac[key] = [i for i in lac[key] if i < n_layers]
        return parse_config(raw)

    def to_json(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


def load_config(path: str | Path) -> GlmConfig:
    """Read a config.json (file, or a checkpoint directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"{p}: no such config file")
    try:
        raw = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    try:
        return parse_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def parse_config(raw: dict[str, Any]) -> GlmConfig:
    """Validate a config dict (nested under `text_config` or flat) and derive its schedule."""
    model_type = raw.get("model_type")
    nested = "text_config" in raw
    if nested:
        if model_type not in WRAPPER_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not glm5_next (GLM-5.3-Flash)")
        text_raw = raw["text_config"]
        if not isinstance(text_raw, dict):
            raise ConfigError("text_config must be an object")
        if text_raw.get("model_type", "glm5_next_text") not in TEXT_MODEL_TYPES:
            raise ConfigError(f"text_config.model_type {text_raw.get('model_type')!r} is not glm5_next_text")
    else:
        if model_type not in TEXT_MODEL_TYPES + WRAPPER_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not glm5_next (GLM-5.3-Flash)")
        text_raw = raw
    text = {**_TEXT_DEFAULTS, **text_raw}
    _flatten_linear_attn_config(text)
    _check_dims(text)
    n = text["num_hidden_layers"]
    attn = _attention_schedule(text, n)
    mlp = _mlp_schedule(text, n)
    vision = _vision_dims(raw.get("vision_config")) if nested else None
    return GlmConfig(text=text, attn_types=attn, mlp_types=mlp, vision=vision, raw=raw, nested=nested,
                     indexer_full=_indexer_schedule(text, n))


def _indexer_schedule(text: dict[str, Any], n: int) -> tuple[bool, ...]:
    """`indexer_types`: "full" layers own indexer weights, "shared" ones reuse the previous top-k."""
    types = text.get("indexer_types")
    if types is None:
        return (True,) * n
    if not isinstance(types, list) or len(types) != n or any(t not in ("full", "shared") for t in types):
        raise ConfigError(f"indexer_types must list {n} entries of 'full' or 'shared'")
    return tuple(t == "full" for t in types)


def _flatten_linear_attn_config(text: dict[str, Any]) -> None:
    lac = text.get("linear_attn_config")
    if lac is None:
        return
    if not isinstance(lac, dict):
        raise ConfigError("linear_attn_config must be an object")
    for src, dst in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                     ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        if src in lac and dst in text and dst in lac and lac[src] != text[dst]:
            raise ConfigError(f"linear_attn_config.{src}={lac[src]} disagrees with {dst}={text[dst]}")
        if src in lac:
            text[dst] = lac[src]


_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
             "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank",
             "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads", "index_kpool",
             "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "hc_mult")


def _check_dims(text: dict[str, Any]) -> None:
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in text:
            raise ConfigError(f"text config has no {key}")
    for key in _POSITIVE:
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if text["qk_rope_head_dim"] != 0:
        raise ConfigError(f"qk_rope_head_dim must be 0 (GLM-5.3 DSA is NoPE), got {text['qk_rope_head_dim']}")
    if text["index_topk"] % text["index_kpool"]:
        raise ConfigError(f"index_topk {text['index_topk']} is not divisible by index_kpool {text['index_kpool']}")
    if text["num_experts_per_tok"] > text["n_routed_experts"]:
        raise ConfigError("num_experts_per_tok exceeds n_routed_experts")
    if not isinstance(text.get("n_shared_experts"), int) or text["n_shared_experts"] < 0:
        raise ConfigError(f"n_shared_experts must be a non-negative integer, got {text.get('n_shared_experts')!r}")
    if text.get("tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings is true; GLM-5.3-Flash has an untied lm_head")


def _attention_schedule(text: dict[str, Any], n: int) -> tuple[str, ...]:
    """`layer_types` first, then `linear_attn_config.full_attn_layers`, then the every-4th pattern."""
    from_lac = _schedule_from_linear_attn_config(text.get("linear_attn_config"), n)
    layer_types = text.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n:
            raise ConfigError(f"layer_types must list {n} entries (num_hidden_layers), got "
                              f"{len(layer_types) if isinstance(layer_types, list) else layer_types!r}")
        unknown = sorted({t for t in layer_types if t not in _ATTN_NAMES})
        if unknown:
            raise ConfigError(f"layer_types has unknown attention types {unknown}")
        sched = tuple(_ATTN_NAMES[t] for t in layer_types)
        if from_lac is not None and from_lac != sched:
            bad = [i for i in range(n) if from_lac[i] != sched[i]]
            raise ConfigError(f"layer_types and linear_attn_config disagree at layers {bad}")
        return sched
    if from_lac is not None:
        return from_lac
    return tuple(DSA if (i + 1) % 4 == 0 else KDA for i in range(n))


def _schedule_from_linear_attn_config(lac: Any, n: int) -> tuple[str, ...] | None:
    if not isinstance(lac, dict) or "full_attn_layers" not in lac:
        return None
    full = lac["full_attn_layers"]
    kda = lac.get("kda_layers")
    if not isinstance(full, list) or any(not isinstance(i, int) or not 0 <= i < n for i in full):
        raise ConfigError(f"linear_attn_config.full_attn_layers must be layer indices below {n}")
    if kda is not None and sorted(set(kda) | set(full)) != list(range(n)) or kda and set(kda) & set(full):
        raise ConfigError("linear_attn_config.kda_layers and full_attn_layers must partition the layers")
    return tuple(DSA if i in set(full) else KDA for i in range(n))


def _mlp_schedule(text: dict[str, Any], n: int) -> tuple[str, ...]:
    types = text.get("mlp_layer_types")
    k = text.get("first_k_dense_replace")
    if types is None:
        k = 3 if k is None else k
        return tuple(DENSE if i < k else MOE for i in range(n))
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"mlp_layer_types must list {n} entries (num_hidden_layers)")
    unknown = sorted({t for t in types if t not in _MLP_NAMES})
    if unknown:
        raise ConfigError(f"mlp_layer_types has unknown types {unknown}")
    sched = tuple(_MLP_NAMES[t] for t in types)
    if k is not None and sched != tuple(DENSE if i < k else MOE for i in range(n)) and sched.count(DENSE) != k:
        raise ConfigError(f"first_k_dense_replace={k} disagrees with mlp_layer_types ({sched.count(DENSE)} dense)")
    return sched


def _vision_dims(vc: Any) -> VisionDims | None:
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise ConfigError("vision_config must be an object")
    v = {**_VISION_DEFAULTS, **vc}
    return VisionDims(depth=v["depth"], hidden=v["hidden_size"], intermediate=v["intermediate_size"],
                      heads=v["num_heads"], patch=v["patch_size"], temporal_patch=v["temporal_patch_size"],
                      merge=v["spatial_merge_size"], out_hidden=v["out_hidden_size"],
                      proj_intermediate=v["projection_intermediate_size"], in_channels=v["in_channels"])
