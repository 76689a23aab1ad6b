"""GLM-5.3-Flash config: unwrap, validate, derive the per-layer schedule, cut to the first N layers."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any

from glmconv.errors import ConfigError
from glmconv.text import show

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


def parse_config(raw: dict[str, Any]) -> GlmConfig:
    """Validate a config dict (nested under `text_config` or flat) and derive its schedule."""
    model_type = raw.get("model_type")
    nested = "text_config" in raw
    check_fields(raw, _WRAPPER_SCHEMA if nested else {})
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
    where = "text_config." if nested else ""
    text = {**_TEXT_DEFAULTS, **text_raw}
    check_fields(text, TEXT_SCHEMA, where)
    if isinstance(text.get("linear_attn_config"), dict):
        check_fields(text["linear_attn_config"], LAC_SCHEMA, f"{where}linear_attn_config.")
    if isinstance(raw.get("quantization_config"), dict):
        check_fields(raw["quantization_config"], _QUANT_SCHEMA, "quantization_config.")
        weight_block_size(raw)
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


# ---- the schema: every key glmconv reads, its JSON type and range (values outside are refused) -------------

MAX_CONFIG_BYTES = 16 << 20  # the release's config.json is ~4 KB
MAX_DIM = 1 << 24  # any width, vocabulary or count: 16.7M, 100x the release's largest (vocab 154,880)
MAX_LAYERS = 1024  # the release has 45 (+1 MTP); per-layer schedules are built in memory


@dataclass(frozen=True)
class Field:
    """One config key: the JSON type its value must have and, for numbers, the closed range it lies in.

    Config values reach shapes, `range()` and torch; a string, a float or a bool where an integer belongs
    would fail far from here with a Python error, so they are refused here, naming the key.
    """

    kind: type  # int, float (any JSON number), bool, str, dict (object), list
    low: float | None = None
    high: float | None = None
    items: type | None = None  # lists: the type of every element
    nullable: bool = False  # JSON null is accepted (the key then counts as absent)

    def expected(self) -> str:
        """What the value must be, in words: "a positive integer up to 1024"."""
        items = _TYPE_WORDS.get(self.items, "values") if self.items else "values"
        word = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
                dict: "an object", list: f"a list of {items}s"}[self.kind]
        if self.kind is int and self.low in (0, 1):
            word = "a positive integer" if self.low == 1 else "a non-negative integer"
        elif self.low is not None:
            word += f" >= {_num(self.low)}"
        if self.high is not None:
            word += f" up to {_num(self.high)}"
        return word + (" or null" if self.nullable else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if not _is_kind(value, self.kind):
            return False
        if self.kind is list:
            return self.items is None or all(_is_kind(v, self.items) for v in value)
        if self.kind in (int, float):
            return (type(value) is int or math.isfinite(value)) and (self.low is None or value >= self.low) and (
                self.high is None or value <= self.high)
        return True


_TYPE_WORDS = {int: "integer", str: "string", float: "number"}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _is_kind(value: Any, kind: type) -> bool:
    """JSON types as Python sees them: bool is not an int, an int is a number, a float is not an int."""
    if kind is float:
        return type(value) in (int, float)
    return type(value) is kind


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        n = len(value)
        return f"a list of {n} item{'s' * (n != 1)}" if isinstance(value, list) else f"an object of {n} keys"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(type(value), "a value")


def found(value: Any) -> str:
    """A config value as a message shows it: `'4096' (a string)`, `a list of 3 items`."""
    if value is None or isinstance(value, (list, dict)):
        return _json_type(value)
    shown = "true" if value is True else "false" if value is False else show(value, quote=isinstance(value, str))
    return f"{shown} ({_json_type(value)})"


def check_fields(obj: dict[str, Any], schema: dict[str, Field], where: str = "") -> None:
    """Every key of `schema` present in `obj` has the declared type and range; one ConfigError otherwise."""
    for key, spec in schema.items():
        if key in obj and not spec.accepts(obj[key]):
            raise ConfigError(f"{where}{key} must be {spec.expected()}, got {found(obj[key])}")


def _dim(high: int = MAX_DIM, low: int = 1, nullable: bool = False) -> Field:
    return Field(int, low, high, nullable=nullable)


_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
             "num_attention_heads", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank",
             "qk_nope_head_dim", "v_head_dim", "index_topk", "index_head_dim", "index_n_heads", "index_kpool",
             "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "hc_mult", "n_group", "topk_group",
             "hc_sinkhorn_iters")
TEXT_SCHEMA: dict[str, Field] = {
    **{key: _dim() for key in _POSITIVE},
    "num_hidden_layers": _dim(MAX_LAYERS),
    "n_routed_experts": _dim(1 << 16),
    "n_shared_experts": _dim(1 << 16, low=0),
    "qk_rope_head_dim": _dim(low=0),
    "num_nextn_predict_layers": _dim(16, low=0, nullable=True),
    "first_k_dense_replace": _dim(MAX_LAYERS, low=0, nullable=True),
    "max_position_embeddings": _dim(1 << 31),
    "rms_norm_eps": Field(float, 0, 1),
    "hc_eps": Field(float, 0, 1),
    "swiglu_limit": Field(float, 0),
    "routed_scaling_factor": Field(float, 0),
    "linear_lower_bound": Field(float),
    "tie_word_embeddings": Field(bool),
    "mhc": Field(bool),
    "norm_topk_prob": Field(bool),
    "index_kpool_always_select_tail": Field(bool),
    "scoring_func": Field(str),
    "layer_types": Field(list, items=str, nullable=True),
    "mlp_layer_types": Field(list, items=str, nullable=True),
    "indexer_types": Field(list, items=str, nullable=True),
    "linear_attn_config": Field(dict, nullable=True),
}
LAC_SCHEMA: dict[str, Field] = {
    "full_attn_layers": Field(list, items=int), "kda_layers": Field(list, items=int, nullable=True),
    "num_heads": _dim(), "head_dim": _dim(), "short_conv_kernel_size": _dim(),
}
VISION_SCHEMA: dict[str, Field] = {key: _dim() for key in _VISION_DEFAULTS}
_WRAPPER_SCHEMA: dict[str, Field] = {
    "text_config": Field(dict), "vision_config": Field(dict, nullable=True),
    "quantization_config": Field(dict, nullable=True),
}
_QUANT_SCHEMA: dict[str, Field] = {  # weight_block_size: `weight_block_size`, which also checks its length and range
    "quant_method": Field(str), "modules_to_not_convert": Field(list, items=str, nullable=True),
}
BLOCK_SIZE_KEY = "quantization_config.weight_block_size"


def weight_block_size(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The FP8 scale block (rows, columns) a config declares, None where it declares none.

    A loader reads it to map each `_scale_inv` element onto its weight: a zero, a negative, a bool, a float or
    a length other than 2 is no block size, and is refused here, naming the key. Whether it agrees with the
    scales on disk is `glmconv.numerics.fp8.check_block_size`'s question.
    """
    q = raw.get("quantization_config")
    if not isinstance(q, dict) or "weight_block_size" not in q:
        return None
    value = q["weight_block_size"]
    if (type(value) is not list or len(value) != 2
            or not all(type(v) is int and 1 <= v <= MAX_DIM for v in value)):
        raise ConfigError(f"{BLOCK_SIZE_KEY} must be a list of 2 positive integers up to {MAX_DIM} (the rows and "
                          f"columns of one scale block, [128, 128] in the release), got {_shown_list(value)}")
    return value[0], value[1]


def _shown_list(value: Any) -> str:
    """A short list of numbers as JSON writes it (`[0, 0]`, `[true, true]`); anything else as `found` says it."""
    if type(value) is list and len(value) <= 4 and all(type(v) in (int, float, bool) for v in value):
        text = json.dumps(value)
        if len(text) <= 80:
            return text
    return found(value)


def _check_dims(text: dict[str, Any]) -> None:
    """Relations between keys (the schema has checked each key alone)."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in text:
            raise ConfigError(f"text config has no {key}")
    if text["qk_rope_head_dim"] != 0:
        raise ConfigError(f"qk_rope_head_dim must be 0 (GLM-5.3 DSA is NoPE), got {text['qk_rope_head_dim']}")
    if text["index_topk"] % text["index_kpool"]:
        raise ConfigError(f"index_topk {text['index_topk']} is not divisible by index_kpool {text['index_kpool']}")
    if text["num_experts_per_tok"] > text["n_routed_experts"]:
        raise ConfigError("num_experts_per_tok exceeds n_routed_experts")
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
    check_fields(v, VISION_SCHEMA, "vision_config.")
    return VisionDims(depth=v["depth"], hidden=v["hidden_size"], intermediate=v["intermediate_size"],
                      heads=v["num_heads"], patch=v["patch_size"], temporal_patch=v["temporal_patch_size"],
                      merge=v["spatial_merge_size"], out_hidden=v["out_hidden_size"],
                      proj_intermediate=v["projection_intermediate_size"], in_channels=v["in_channels"])
