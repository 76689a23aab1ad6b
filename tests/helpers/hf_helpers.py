"""Reading an HF checkpoint in tests with safetensors itself (never through glmconv's own readers)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"


def index(path: Path) -> dict:
    return json.loads((path / INDEX_NAME).read_text())


def headers(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every tensor in every shard the index names."""
    out = {}
    for shard in sorted(set(index(path)["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def save_with_transformers(src: Path, out: Path, dtype: str, max_shard_size: str | None = None) -> Path:
    """`Glm5NextForConditionalGeneration.from_pretrained(src, dtype=...).save_pretrained(out)`: a checkpoint as
    transformers itself writes it (conv1d kept F32 in a BF16 save, no MTP layer, one file unless sharded)."""
    import torch
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(src, dtype=getattr(torch, dtype))
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out


def raw_tensors(ckpt: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor's dtype, shape and raw data bytes, straight from the shard files."""
    from glmconv.io.safetensors.header import read_header

    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        header = read_header(shard)
        data = shard.read_bytes()
        for e in header.entries.values():
            out[e.name] = (e.dtype, e.shape, data[header.data_start + e.begin:header.data_start + e.end])
    return out
