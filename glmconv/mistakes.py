"""One wording for each mistake a user makes with checkpoint arguments: what was found where, what the command
takes there, and the command they most likely meant. convert, export, relayout, verify and parity all say it
through these functions, so the same mistake reads the same whichever command met it.
"""

from __future__ import annotations

import json
from pathlib import Path

from glmconv.config import GlmConfig
from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import expect_directory, optional_file
from glmconv.io.config_file import load_config
from glmconv.io.file_names import CONFIG_NAME
from glmconv.io.safetensors.checkpoint import is_hf_checkpoint
from glmconv.io.torch_dist.metadata import is_torch_dist
from glmconv.text import count, show

HF = "HF"
TORCH_DIST = "torch_dist"


def kind(path: str | Path) -> str | None:
    """HF or TORCH_DIST when `path` is such a checkpoint directory, else None (missing, a file, neither)."""

    p = Path(path)
    if is_torch_dist(p):
        return TORCH_DIST
    return HF if is_hf_checkpoint(p) else None


def _a(what: str) -> str:
    return f"an {what}" if what == HF else f"a {what}"


def wrong_kind(path: str | Path, found: str, command: str, role: str, meant: str) -> CheckpointError:
    """`path` is a `found` checkpoint where `command` takes the other kind as `role`."""
    wanted = HF if found == TORCH_DIST else TORCH_DIST
    return CheckpointError(f"{path}: this is {_a(found)} checkpoint, but {command} takes {_a(wanted)} checkpoint as "
                           f"{role}; did you mean `{meant}`?")


def expect_hf(path: str | Path, command: str, role: str = "HF_DIR") -> None:
    """Refuse a file (a shard, the index, config.json) or a torch_dist checkpoint given where `command` reads an
    HF checkpoint directory (convert: export was meant)."""
    expect_directory(path)
    if kind(path) == TORCH_DIST:
        meant = f"glmconv export {path} OUT_DIR" if command == "convert" else f"glmconv {command} HF_DIR {path}"
        raise wrong_kind(path, TORCH_DIST, command, role, meant)


def expect_torch_dist(path: str | Path, command: str, role: str = "MCORE_DIR") -> None:
    """Refuse a file (a .distcp, .metadata, config.json) or an HF checkpoint given where `command` reads a
    torch_dist checkpoint directory (convert was meant first)."""
    expect_directory(path)
    if kind(path) == HF:
        raise wrong_kind(path, HF, command, role, f"glmconv convert {path} OUT_DIR")


def check_pair(command: str, hf_dir: str | Path, mcore_dir: str | Path) -> None:
    """verify and parity: HF_DIR then MCORE_DIR; the two given the other way round are named as a swap."""
    expect_directory(hf_dir)
    expect_directory(mcore_dir)
    if kind(hf_dir) == TORCH_DIST and kind(mcore_dir) == HF:
        raise wrong_kind(hf_dir, TORCH_DIST, command, "HF_DIR", f"glmconv {command} {mcore_dir} {hf_dir}")
    expect_hf(hf_dir, command)
    expect_torch_dist(mcore_dir, command)


# Keys of transformers' Glm5NextTextConfig (5.23) that neither shape the model nor change what it computes at
# inference: switches of a forward call or of generation, bookkeeping, token ids, and what only training reads
# (init range, dropout, the router's aux-loss weight). transformers' `save_pretrained` writes them; a difference in
# them is noted, never "another model". Every other key is the model's (a test classifies every key of the class).
# Keys of that class that are the model's but that glmconv does not read: what they change shows in the tensors
# (attention_bias adds biases) or is fixed for this model (MLA's head dims, the activation, the model type).
MODEL_KEYS_UNREAD = frozenset({"attention_bias", "head_dim", "hidden_act", "model_type", "num_key_value_heads",
                               "qk_head_dim"})
RUNTIME_KEYS = frozenset({
    "_name_or_path", "architectures", "attention_dropout", "bos_token_id", "chunk_size_feed_forward", "dtype",
    "eos_token_id", "id2label", "initializer_range", "is_encoder_decoder", "label2id", "output_attentions",
    "output_hidden_states", "output_router_logits", "pad_token_id", "problem_type", "return_dict",
    "router_aux_loss_coef", "torch_dtype", "transformers_version", "use_cache"})


def check_same_model(hf_dir: str | Path, mcore_dir: str | Path) -> list[str]:
    """Refuse MCORE_DIR whose config.json (convert leaves one) describes another model than HF_DIR's; the keys
    that differ without making another model (RUNTIME_KEYS), to be noted."""

    if not (Path(hf_dir).is_dir() and Path(mcore_dir).is_dir()):
        return []  # the checks that read the checkpoints refuse what is missing
    hf_path, mc_path = optional_file(Path(hf_dir), CONFIG_NAME), optional_file(Path(mcore_dir), CONFIG_NAME)
    if hf_path is None or mc_path is None:
        return []  # the checks that read the checkpoints refuse what is missing
    return check_same_config(load_config(hf_path), load_config(mc_path), hf_dir, mcore_dir)


def check_same_config(ours: GlmConfig, theirs: GlmConfig, hf_dir: str | Path, mcore_dir: str | Path) -> list[str]:
    """`check_same_model` on the two configs as read: refused naming the first model keys that differ."""
    differ = [k for k in set(ours.text) | set(theirs.text) if ours.text.get(k) != theirs.text.get(k)]
    keys = sorted((k for k in differ if k not in RUNTIME_KEYS), key=lambda k: (not _scalar(ours.text.get(k)), k))
    if keys or (ours.attn_types, ours.mlp_types) != (theirs.attn_types, theirs.mlp_types):
        diff = "; ".join(f"{k}: {show(json.dumps(theirs.text.get(k)))} in {mcore_dir}, "
                         f"{show(json.dumps(ours.text.get(k)))} in {hf_dir}" for k in keys[:2])
        more = f"; {count(len(keys) - 2, 'other key')}" if len(keys) > 2 else ""
        raise CheckpointError(f"{mcore_dir} is not a conversion of {hf_dir}: another model "
                              f"({diff or 'a different layer schedule'}{more})")
    return sorted(differ)


def runtime_note(keys: list[str]) -> str | None:
    """The note for config keys that differ without making another model."""
    if not keys:
        return None
    return (f"config.json keys that differ but change neither the model nor its numerics (ignored): "
            f"{', '.join(keys[:6])}{f' and {len(keys) - 6} more' if len(keys) > 6 else ''}")


def _scalar(value: object) -> bool:
    """Differences in plain numbers and names read best: they come first."""
    return not isinstance(value, (list, dict))
