"""Inspect a Megatron torch_dist checkpoint from its tracker, metadata.json and DCP `.metadata` only."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import check_checkpoint_dir, inside, optional_file, require_file
from glmconv.io.dtypes import torch_dtype_code
from glmconv.io.file_names import (
    COMMON_PT_NAME,
    COMMON_STATE,
    CONFIG_NAME,
    DCP_METADATA_NAME,
    KEPT_DIR,
    MCORE_METADATA_NAME,
    RELEASE,
    TRACKER_NAME,
)
from glmconv.io.jsonfile import load_json_file
from glmconv.io.torch_dist.metadata_check import load_metadata
from glmconv.io.torch_dist.safe_unpickle import is_a
from glmconv.text import decimal

TORCH_DIST = "torch_dist"


@dataclass(frozen=True)
class DcpTensor:
    """A tensor as the DCP metadata records it: global shape and safetensors-style dtype code."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class DcpCheckpoint:
    """A torch_dist checkpoint: where it is, its tensors, its non-tensor entries and its common state."""

    root: Path
    iter_dir: Path
    iteration: str
    tensors: dict[str, DcpTensor]
    objects: list[str] = field(default_factory=list)
    common_state: str | None = None  # "common.pt" (older layout), the DCP key (0.19), or None
    metadata: Any = field(default=None, repr=False, compare=False)  # `.metadata` as loaded (stand-ins): for readers


def is_torch_dist(path: Path) -> bool:
    """A tracker-holding root or an iteration directory with metadata.json."""
    return path.is_dir() and ((path / TRACKER_NAME).is_file() or (path / MCORE_METADATA_NAME).is_file())


def resolve_iter_dir(path: str | Path) -> tuple[Path, str]:
    """Follow the tracker file to `iter_{:07d}` / `release`; an iteration dir is accepted as is."""
    p = check_checkpoint_dir(Path(path))
    tracker = optional_file(p, TRACKER_NAME)
    if tracker is None:
        if optional_file(p, MCORE_METADATA_NAME) is not None:
            return p, p.name
        raise CheckpointError(f"{p}: not a torch_dist checkpoint (no {TRACKER_NAME} or {MCORE_METADATA_NAME})")
    with open(tracker, "rb") as fh:  # an iteration number or "release": a few bytes, whatever the file's size
        text = fh.read(64).decode("utf-8", "replace").strip()
    if text == RELEASE:
        sub = RELEASE
    elif decimal(text) is not None:
        sub = f"iter_{decimal(text):07d}"
    else:
        raise CheckpointError(f"{TRACKER_NAME}: expected an iteration number or 'release', got {text[:40]!r}")
    if not inside(p, sub).is_dir():
        raise CheckpointError(f"{TRACKER_NAME}: points to {sub}, which is missing")
    return p / sub, text


def inspect_torch_dist(path: str | Path) -> DcpCheckpoint:
    """Read the tensor list of a torch_dist checkpoint without loading any tensor data."""
    iter_dir, iteration = resolve_iter_dir(path)
    _check_backend(iter_dir)
    meta_path = require_file(iter_dir, DCP_METADATA_NAME,
                             f"{iter_dir.name}/{DCP_METADATA_NAME}: missing (checkpoint incomplete?)")
    metadata = load_metadata(meta_path, stand_ins=True)  # names, shapes, dtypes, files: no torch needed
    _merge_kept(metadata, iter_dir)
    tensors, objects = _entries(metadata, meta_path)
    _check_storage(metadata, iter_dir)
    common = COMMON_PT_NAME if optional_file(iter_dir, COMMON_PT_NAME) is not None else next(
        (o for o in objects if o.split("/", 1)[0] == COMMON_STATE), None)
    return DcpCheckpoint(root=Path(path), iter_dir=iter_dir, iteration=iteration, tensors=tensors,
                         objects=objects, common_state=common, metadata=metadata)


def _merge_kept(metadata: Any, iter_dir: Path) -> None:
    """The tensors of the KEPT_DIR sidecar (what no trainer loads) joined to the checkpoint's own, its data files
    named relative to the iteration directory; a checkpoint without one (or from before it) is left as it is."""
    if not (iter_dir / KEPT_DIR).is_dir():
        return
    path = require_file(iter_dir / KEPT_DIR, DCP_METADATA_NAME,
                        f"{KEPT_DIR}/{DCP_METADATA_NAME}: missing (checkpoint incomplete?)")
    kept = load_metadata(path, stand_ins=True)
    where = f"{KEPT_DIR}/{DCP_METADATA_NAME}"
    for key, md in kept.state_dict_metadata.items():
        if not is_a(md, "TensorStorageMetadata"):
            raise CheckpointError(f"{where}: entry {key} is not a tensor")
        if key in metadata.state_dict_metadata:
            raise CheckpointError(f"{where}: {key} is stored in the checkpoint too")
        metadata.state_dict_metadata[key] = md
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    for index, info in (kept.storage_data or {}).items():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or "/" in rel:
            raise CheckpointError(f"{where}: data file {rel!r} is outside {KEPT_DIR}")
        info.relative_path = f"{KEPT_DIR}/{rel}"
        storage[index] = info
    metadata.storage_data = storage


def _check_backend(iter_dir: Path) -> None:
    path = require_file(iter_dir, MCORE_METADATA_NAME,
                        f"{iter_dir.name}/{MCORE_METADATA_NAME}: missing (not a Megatron dist checkpoint)")
    data: Any = load_json_file(path, source=MCORE_METADATA_NAME)
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    if backend != TORCH_DIST:
        raise CheckpointError(f"{MCORE_METADATA_NAME}: sharded_backend is {backend!r}, expected 'torch_dist'")


def _entries(metadata: Any, meta_path: Path) -> tuple[dict[str, DcpTensor], list[str]]:
    tensors: dict[str, DcpTensor] = {}
    objects: list[str] = []
    for key, md in metadata.state_dict_metadata.items():
        if is_a(md, "TensorStorageMetadata"):
            tensors[key] = DcpTensor(key, tuple(int(d) for d in md.size), torch_dtype_code(md.properties.dtype))
        elif is_a(md, "BytesStorageMetadata"):
            objects.append(key)
        else:
            raise CheckpointError(f"{meta_path.name}: entry {key} has unknown storage type {type(md).__name__}")
    return tensors, objects


def _check_storage(metadata: Any, iter_dir: Path) -> None:
    """Every data file the metadata points to exists inside the directory and is long enough."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if rel not in needed:  # each file checked once, not once per item (thousands)
            inside(iter_dir, rel, f"{DCP_METADATA_NAME}: data file")
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(needed.items()):
        path = require_file(iter_dir, rel, f"{rel}: data file listed in {DCP_METADATA_NAME} is missing from {iter_dir}",
                            f"{DCP_METADATA_NAME}: data file")
        if os.path.getsize(path) < end:
            raise CheckpointError(f"{rel}: truncated: metadata needs {end} bytes, file has {os.path.getsize(path)}")


def config_path(root: Path, iter_dir: Path, option: str | None = None) -> Path:
    """Where convert leaves a torch_dist checkpoint's config.json: beside the tracker or in the iteration dir.

    `option`: the command's option that names one instead (`--config`), offered in the error; None where the
    command has none (parity, relayout), so no hint names an option that does not exist."""
    for folder in (root, iter_dir, iter_dir.parent):
        found = optional_file(folder, CONFIG_NAME)
        if found is not None:
            return found
    instead = f", or pass {option} CONFIG" if option else ""
    raise CheckpointError(f"{root}: torch_dist checkpoint has no {CONFIG_NAME} next to it (convert writes one there): "
                          f"copy the model's {CONFIG_NAME} into {root}{instead}")
