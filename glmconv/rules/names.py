"""Name prefixes and template expansion: with `table.py`, the only place tensor names are built."""

from __future__ import annotations

import re
from collections.abc import Iterable

from glmconv.text import decimal

HF_TEXT_PREFIX = "model.language_model."
HF_FLAT_PREFIX = "model."
HF_VISUAL_PREFIX = "model.visual."
HF_PREFIXES = (HF_TEXT_PREFIX, HF_FLAT_PREFIX)
# megatron-core 0.19.2 names the module `mtp_model_layer` but keys GPT MTP checkpoints `transformer_layer.`
# (MultiTokenPredictionLayer.sharded_state_dict remaps it for backward compatibility): the key is what a trainer loads.
MTP_INNER_LAYER = "transformer_layer."
SCALE_SUFFIX = "_scale_inv"


def hf_layer(text_prefix: str, layer: int) -> str:
    return f"{text_prefix}layers.{layer}."


def mcore_layer(layer: int) -> str:
    return f"decoder.layers.{layer}."


def mcore_mtp(index: int) -> str:
    return f"mtp.layers.{index}."


def mcore_mtp_layer(index: int) -> str:
    return mcore_mtp(index) + MTP_INNER_LAYER


def expand(template: str, **values: object) -> str:
    """Fill a rule template (`{layer}`, `{e}`, ...)."""
    return template.format(**values)


SWIGLU_GATE_UP = ("gate_proj.weight", "up_proj.weight")  # an HF SwiGLU fc1's two halves, in the rules' order


def is_swiglu_gate(name: str) -> bool:
    """Whether an HF SwiGLU fc1 tensor is the gate half (silu and the upper clamp act on it), not the up half."""
    return name.endswith("." + SWIGLU_GATE_UP[0])


def scale_name(weight: str) -> str:
    """The FP8 block-scale tensor that pairs with `weight`."""
    return weight + SCALE_SUFFIX


def scale_owner(name: str) -> str | None:
    """The weight a `_scale_inv` tensor belongs to, or None."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def hf_layer_index(name: str, text_prefix: str) -> int | None:
    """Layer number of an HF tensor name under `text_prefix`, or None for non-layer tensors."""
    head = text_prefix + "layers."
    if not name.startswith(head):
        return None
    digits = name[len(head):].split(".", 1)[0]
    return decimal(digits)


KEPT_PREFIX = "glmconv_kept."  # a tensor the layout's trainer has no parameter for, kept for export


def kept(name: str) -> str:
    """`name` stored under KEPT_PREFIX: in the checkpoint for export, loaded by no trainer."""
    return name if name.startswith(KEPT_PREFIX) else KEPT_PREFIX + name


def is_kept(name: str) -> bool:
    """A Megatron name stored under KEPT_PREFIX (in the checkpoint's `glmconv_kept/` sidecar, not its DCP)."""
    return name.startswith(KEPT_PREFIX)


def unkept(name: str) -> str:
    """The Megatron name under KEPT_PREFIX (the name itself when it is not kept)."""
    return name[len(KEPT_PREFIX):] if name.startswith(KEPT_PREFIX) else name


def mcore_layer_index(name: str) -> int | None:
    """Decoder layer number of a Megatron tensor name (kept or not), or None (MTP, global and vision tensors)."""
    name = unkept(name)
    head = mcore_layer(0)[: -len("0.")]
    if not name.startswith(head):
        return None
    digits = name[len(head):].split(".", 1)[0]
    return decimal(digits)


def any_layer_index(name: str) -> int | None:
    """Layer number of an HF (either text prefix) or Megatron decoder tensor name, or None."""
    for prefix in HF_PREFIXES:
        layer = hf_layer_index(name, prefix)
        if layer is not None:
            return layer
    return mcore_layer_index(name)


def detect_text_prefix(names: list[str] | set[str]) -> str | None:
    """Which HF text prefix a checkpoint uses: the release's, the flat third-party one, or None."""
    counts = {p: 0 for p in HF_PREFIXES}
    for n in names:
        if n.startswith(HF_TEXT_PREFIX):
            counts[HF_TEXT_PREFIX] += 1
        elif n.startswith(HF_FLAT_PREFIX) and not n.startswith(HF_VISUAL_PREFIX):
            counts[HF_FLAT_PREFIX] += 1
    best = max(counts, key=lambda p: counts[p])
    return best if counts[best] else None


MCORE_MTP_PREFIX = "mtp.layers."
MCORE_VISION_PREFIX = "vision_model."


def swap_text_prefix(name: str, new_prefix: str) -> str | None:
    """`name` re-spelled under the other HF text prefix, or None if it has no text prefix."""
    if name.startswith(HF_TEXT_PREFIX):
        return new_prefix + name[len(HF_TEXT_PREFIX):] if new_prefix != HF_TEXT_PREFIX else None
    if name.startswith(HF_FLAT_PREFIX) and not name.startswith(HF_VISUAL_PREFIX):
        return new_prefix + name[len(HF_FLAT_PREFIX):] if new_prefix != HF_FLAT_PREFIX else None
    return None


def mcore_part(name: str) -> str:
    """Which optional part a Megatron tensor (kept or not) belongs to: "mtp", "vision" or "text"."""
    name = unkept(name)
    if name.startswith(MCORE_MTP_PREFIX):
        return "mtp"
    return "vision" if name.startswith(MCORE_VISION_PREFIX) else "text"


_HF_LAYER_RE = re.compile("^(?:" + "|".join(re.escape(p + "layers.") for p in HF_PREFIXES) + r")(\d+)\.", re.M)


def hf_parts_present(names: Iterable[str], num_layers: int) -> set[str]:
    """The optional parts ("mtp", "vision") any of `names` belongs to, in one regex pass (76k names)."""
    joined = "\n".join(names)
    parts = {"mtp"} if any(int(i) >= num_layers for i in set(_HF_LAYER_RE.findall(joined))) else set()
    if re.search("^" + re.escape(HF_VISUAL_PREFIX), joined, re.M):
        parts.add("vision")
    return parts


def mcore_parts_present(names: Iterable[str]) -> set[str]:
    """The optional parts ("mtp", "vision") any of these Megatron names belongs to."""
    return {mcore_part(n) for n in names} - {"text"}


EXTRA_STATE = "._extra_state"
WEIGHT_SUFFIX = ".weight"


def is_extra_state(key: str) -> bool:
    """A Transformer Engine module's `_extra_state` entry (a state dict's key, or a DCP object key), not a weight."""
    return key.endswith(EXTRA_STATE) or EXTRA_STATE + "/" in key


def sharded_object_key(key: str, offset: tuple[int, ...] = (0,), shape: tuple[int, ...] = (1,)) -> str:
    """DCP key of a megatron ShardedObject (`ShardedObject.unique_key`), e.g. `X._extra_state/shard_0_1`."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def extra_state_keys(weight: str, experts: int | None = None) -> list[str]:
    """The `_extra_state` object keys the TE module owning `weight` saves (one per expert when stacked)."""
    if not weight.endswith(WEIGHT_SUFFIX):
        raise ValueError(f"{weight}: a linear's weight ends with {WEIGHT_SUFFIX}")
    key = weight[: -len(WEIGHT_SUFFIX)] + EXTRA_STATE
    if experts is None:
        return [sharded_object_key(key)]
    return [sharded_object_key(key, (e,), (experts,)) for e in range(experts)]


TRAINING_STATE_PREFIXES = ("optimizer.",)  # a trainer's own checkpoint: optimizer moments and fp32 masters


def is_training_state(key: str) -> bool:
    """Tensors of a trainer's checkpoint that are not model weights (export and audit skip them)."""
    return key.startswith(TRAINING_STATE_PREFIXES)
