"""`export --like`: the --like checkpoint's own files -- their names, which tensor each holds, in which order,
their headers and index -- fitted to the tensors an export writes, so that an unchanged round trip gives them
back byte for byte.

A tensor --like lacks may only be the FP8 scale of a weight it holds (an FP8 export of a BF16 --like): it goes
right after its weight. A file left with none of the export's tensors is not written. A header whose tensors
keep their names, dtypes and shapes is written as --like stores it; any other is safetensors' compact JSON with
--like's `__metadata__`, in --like's data order. The index likewise: --like's bytes when its content is what the
export would write, else the export's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmconv.io.checkpoint_files import optional_file
from glmconv.io.file_names import INDEX_NAME, SINGLE_NAME
from glmconv.io.jsonfile import load_json_file
from glmconv.io.safetensors.checkpoint import HfCheckpoint, shard_path
from glmconv.io.safetensors.header import SafetensorsHeader
from glmconv.io.safetensors.writer import PlannedTensor, Shard
from glmconv.rules import names


@dataclass(frozen=True)
class SourceFile:
    """One --like safetensors file as stored: name, header bytes, tensors in data order, `__metadata__`."""

    name: str
    head: bytes
    tensors: tuple[PlannedTensor, ...]
    metadata: dict[str, str] | None


@dataclass(frozen=True)
class LikeFiles:
    """The shards an export writes as --like's files, and its index file's bytes (None: one `model.safetensors`)."""

    shards: list[Shard]
    index: bytes | None


def fit(like: HfCheckpoint, planned: list[PlannedTensor]) -> LikeFiles | str:
    """`planned` laid out in --like's files (`like` as `inspect_hf_checkpoint` read it: its headers not parsed
    again); or, where they cannot hold it, why (naming the first tensor)."""
    index = _index(like.path)
    files = [_source_file(like.path, f, like.headers) for f in _file_names(index[1] if index else None)]
    where = {t.name: (i, pos) for i, f in enumerate(files) for pos, t in enumerate(f.tensors)}
    members: list[list[tuple[tuple[int, int], PlannedTensor]]] = [[] for _ in files]
    for t in planned:
        owner = names.scale_owner(t.name)
        if t.name in where:
            (i, pos), after = where[t.name], 0
        elif owner is not None and owner in where:
            (i, pos), after = where[owner], 1
        else:
            return f"{t.name} is in none of --like's files"
        members[i].append(((pos, after), t))
    shards = [_shard(f, tuple(t for _, t in sorted(got, key=lambda kt: kt[0])))
              for f, got in zip(files, members) if got]
    return LikeFiles(shards, _index_bytes(index, shards) if index is not None else None)


def _index(like: Path) -> tuple[Path, dict[str, Any]] | None:
    """--like's index file and content (checked by `inspect_hf_checkpoint` before); None: one `model.safetensors`."""
    path = optional_file(like, INDEX_NAME)
    return None if path is None else (path, load_json_file(path, source=str(like / INDEX_NAME)))


def _file_names(index: dict[str, Any] | None) -> list[str]:
    return [SINGLE_NAME] if index is None else sorted(set(index["weight_map"].values()))


def _source_file(like: Path, name: str, headers: Mapping[Path, SafetensorsHeader]) -> SourceFile:
    path = shard_path(like, name)
    header = headers[path]  # validated: the raw bytes below are a JSON object
    with open(path, "rb") as f:
        head = f.read(header.data_start)
    stored = sorted(header.entries.values(), key=lambda e: e.begin)
    return SourceFile(name, head, tuple(PlannedTensor(e.name, e.dtype, e.shape) for e in stored),
                      header.metadata if header.has_metadata else None)


def _shard(f: SourceFile, tensors: tuple[PlannedTensor, ...]) -> Shard:
    """`f` holding `tensors`: its own header bytes when they describe exactly these tensors."""
    return Shard(tensors, f.name, f.metadata, f.head if set(tensors) == set(f.tensors) else None)


def _index_bytes(index: tuple[Path, dict[str, Any]], shards: list[Shard]) -> bytes:
    """--like's index file as stored when the export's has the same content; else the export's own."""
    path, stored = index
    meta = stored.get("metadata")
    total = sum(s.nbytes for s in shards)
    weight_map = {t.name: s.name for s in shards for t in s.tensors}
    ours = {"metadata": {**(meta if isinstance(meta, dict) else {}), "total_size": total},
            "weight_map": dict(sorted(weight_map.items()))}
    if ours == stored:
        return path.read_bytes()
    return (json.dumps(ours, indent=2) + "\n").encode("utf-8")
