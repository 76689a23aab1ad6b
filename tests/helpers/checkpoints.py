"""Small checkpoints written straight from the plan, for the tests that read, audit or break one: an HF directory
(`write_hf`) and a torch_dist root (`write_torch_dist`) of zero or random tensors, and `repoint`, which points one
torch_dist entry's storage at bytes appended to its data file."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter

from glmconv.config import parse_config
from glmconv.io.file_names import DCP_METADATA_NAME, INDEX_NAME, RELEASE
from glmconv.io.torch_dist.safe_unpickle import safe_load
from glmconv.plan import build_plan
from glmconv.rules.names import HF_TEXT_PREFIX

# ---- HF ----------------------------------------------------------------------------------------------------

_HF_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}

# layer 0: KDA + dense MLP, layer 1: DSA + MoE, MTP layer 2, a one-block vision tower.
TINY_CONFIG: dict[str, Any] = {
    "model_type": "glm5_next",
    "text_config": {
        "model_type": "glm5_next_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "intermediate_size": 48, "moe_intermediate_size": 16, "num_attention_heads": 2, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 0, "v_head_dim": 8, "index_n_heads": 2,
        "index_head_dim": 8, "index_topk": 8, "index_kpool": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "linear_num_heads": 2, "linear_head_dim": 8, "linear_conv_kernel_dim": 4,
        "hc_mult": 4, "num_nextn_predict_layers": 1,
        "layer_types": ["linear_attention", "deepseek_sparse_attention"], "mlp_layer_types": ["dense", "sparse"],
    },
    "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                      "out_hidden_size": 32, "projection_intermediate_size": 48},
}


def tiny_config(fp8: bool = False) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY_CONFIG)
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    return cfg


def plan_tensors(cfg: dict[str, Any], *, fp8: bool = False, mtp: bool = True, vision: bool = True,
                 prefix: str = HF_TEXT_PREFIX) -> dict[str, torch.Tensor]:
    """Every HF tensor the plan expects, as small zero tensors of the planned dtype."""
    plan = build_plan(parse_config(cfg), fp8=fp8, mtp=mtp, vision=vision, text_prefix=prefix)
    return {n: torch.zeros(s.shape, dtype=_HF_DTYPES[s.dtype]) for n, s in plan.hf_index.items()}


def write_hf(out: Path, cfg: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None, *,
             shards: list[dict[str, torch.Tensor]] | None = None, weight_map: dict[str, str] | None = None,
             fp8: bool = False, n_shards: int = 3) -> Path:
    """Write config.json, `n_shards` safetensors shards and the index (or exactly `shards` / `weight_map`)."""
    cfg = cfg if cfg is not None else tiny_config(fp8)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    if shards is None:
        tensors = tensors if tensors is not None else plan_tensors(cfg, fp8=fp8)
        names = list(tensors)
        shards = [{n: tensors[n] for n in names[i::n_shards]} for i in range(n_shards)]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    wm: dict[str, str] = {}
    for f, shard in zip(files, shards):
        save_file({n: t.contiguous() for n, t in shard.items()}, str(out / f), metadata={"format": "pt"})
        wm.update({n: f for n in shard if n not in wm})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map if weight_map is not None else wm}
    (out / INDEX_NAME).write_text(json.dumps(index))
    return out


# ---- torch_dist ----------------------------------------------------------------------------------------------

_MCORE_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}
COMMON_KEY = "common_state/shard_0_1"  # megatron-core 0.19's ShardedObject("common_state").unique_key


def save_dcp(out: Path, state: dict[str, Any]) -> None:
    """Single-process `torch.distributed.checkpoint.save` (no process group)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(str(out)), no_dist=True)


def mcore_tensors(cfg: dict[str, Any], *, mtp: bool = True, vision: bool = True) -> dict[str, torch.Tensor]:
    plan = build_plan(parse_config(cfg), mtp=mtp, vision=vision)
    return {n: torch.rand(s.shape).to(_MCORE_DTYPES[s.dtype]) for n, s in plan.mcore_index.items()}


def write_torch_dist(root: Path, cfg: dict[str, Any] | None, tensors: dict[str, torch.Tensor], *,
                     iteration: str = "release", common: bool = True,
                     objects_of: dict[str, Any] | None = None) -> Path:
    """A Megatron root: tracker, `release`/`iter_*` dir with metadata.json + DCP files, config.json at the root."""
    sub = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    it = root / sub
    it.mkdir(parents=True)
    state: dict[str, Any] = dict(tensors)
    objects_of = cfg if objects_of is None else objects_of
    if objects_of:  # every linear's `_extra_state`, as convert writes them
        empty = io.BytesIO()
        torch.save([torch.empty(0, dtype=torch.uint8)], empty)
        state.update({k: io.BytesIO(empty.getvalue()) for k in build_plan(parse_config(objects_of)).mcore_objects()})
    if common:
        blob = io.BytesIO()
        torch.save({"checkpoint_version": 3.0, "iteration": 0}, blob)
        state[COMMON_KEY] = io.BytesIO(blob.getvalue())
    save_dcp(it, state)
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    if cfg is not None:
        (root / "config.json").write_text(json.dumps(cfg))
    (root / "latest_checkpointed_iteration.txt").write_text(iteration)
    return root


def small_torch_dist(root: Path, **kw: Any) -> Path:
    """Three tensors (BF16, F32, I64) and no config: the smallest torch_dist root."""
    return write_torch_dist(root, None, {"a.weight": torch.zeros(4, 3, dtype=torch.bfloat16),
                                         "b": torch.zeros(2), "i": torch.zeros(3, dtype=torch.int64)}, **kw)


def repoint(mc: Path, key: str, payload: bytes) -> str:
    """Append `payload` to the data file of entry `key` and point the entry's storage at it; returns the file."""
    meta = mc / RELEASE / DCP_METADATA_NAME
    md = safe_load(meta)
    (index, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == key]
    data = mc / RELEASE / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload)
    md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload))
    meta.write_bytes(pickle.dumps(md))
    return info.relative_path
