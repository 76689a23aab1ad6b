"""Inspect a sharded HF checkpoint from its config, index and shard headers only (no tensor data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmconv.config import GlmConfig
from glmconv.errors import CheckpointError, ConfigError
from glmconv.io.checkpoint_files import check_checkpoint_dir, optional_file, require_file
from glmconv.io.config_file import load_config
from glmconv.io.file_names import CONFIG_NAME, INDEX_NAME, SINGLE_NAME
from glmconv.io.jsonfile import load_json_file
from glmconv.io.safetensors.header import SafetensorsHeader, read_header
from glmconv.numerics.fp8 import check_block_size
from glmconv.rules.names import detect_text_prefix, scale_owner
from glmconv.text import show


@dataclass(frozen=True)
class HfTensor:
    """A tensor as the shard header describes it, and the shard (relative path) that holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str


@dataclass(frozen=True)
class Problem:
    """A per-tensor inconsistency between the index and the shards (kind: "index" or "duplicate")."""

    kind: str
    tensor: str
    file: str
    expected: str
    found: str

    @property
    def message(self) -> str:
        return f"tensor {show(self.tensor)}: expected {self.expected}, found {self.found}"


@dataclass
class HfCheckpoint:
    """What is on disk: config, index file, every tensor's shape/dtype/shard, and the text prefix."""

    path: Path
    config: GlmConfig
    index_file: str | None
    tensors: dict[str, HfTensor]
    text_prefix: str | None
    problems: list[Problem] = field(default_factory=list)
    headers: dict[Path, SafetensorsHeader] = field(default_factory=dict, repr=False, compare=False)  # as read: a
    # reader of the tensors (`HfTensorSource(headers=...)`) need not read each shard's header again

    def tensor_files(self) -> dict[str, Path]:
        """Each tensor's shard file, each shard resolved once (`shard_path`: a release has ~1,000 tensors a shard)."""
        shards = {name: shard_path(self.path, name) for name in {t.file for t in self.tensors.values()}}
        return {n: shards[t.file] for n, t in self.tensors.items()}

    @property
    def quantized(self) -> bool:
        """The config declares FP8 quantisation (the `_scale_inv` tensors are the ground truth)."""
        q = self.config.raw.get("quantization_config")
        return isinstance(q, dict) and q.get("quant_method") == "fp8"


def is_hf_checkpoint(path: Path) -> bool:
    """A directory that looks like an HF checkpoint (config + index or safetensors)."""
    return path.is_dir() and ((path / INDEX_NAME).exists() or (path / SINGLE_NAME).exists()
                              or any(path.glob("*.safetensors")))


def inspect_hf_checkpoint(path: str | Path, *, strict: bool = True) -> HfCheckpoint:
    """Read config, index and shard headers; with `strict`, index/shard disagreements raise too."""
    root = Path(path)
    _check_dir(root)
    config_file = require_file(root, CONFIG_NAME, f"{root}: no {CONFIG_NAME} (not an HF checkpoint directory)")
    config = load_config(config_file)
    index_file, weight_map = _weight_map(root)
    tensors, problems, headers = _read_shards(root, weight_map, index_file)
    if strict and problems:
        p = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{show(p.file)}: {p.message}{more}")
    check_config_block_size(config_file, config, tensors)
    return HfCheckpoint(path=root, config=config, index_file=index_file, tensors=tensors,
                        text_prefix=detect_text_prefix(set(tensors)), problems=problems, headers=headers)


def check_config_block_size(config_file: Path, config: GlmConfig, tensors: dict[str, HfTensor]) -> None:
    """The config's FP8 block size agrees with every `_scale_inv` of an FP8 weight here (numerics.fp8), else one
    ConfigError naming the config file, the key and a scale: convert, audit-names, verify, parity, export's --like
    and the audit of an export all read an HF checkpoint through here."""
    scales = [(name, t.shape, tensors[owner].shape) for name, t in tensors.items()
              if (owner := scale_owner(name)) is not None and owner in tensors]
    try:
        check_block_size(config.raw, scales)
    except ConfigError as exc:
        raise ConfigError(f"{config_file}: {exc}") from None


def _check_dir(root: Path) -> None:
    check_checkpoint_dir(root)
    if not any(root.iterdir()):
        raise CheckpointError(f"{root}: empty directory")


def _weight_map(root: Path) -> tuple[str | None, dict[str, str] | None]:
    """The index's weight_map, or (None, None) for a single `model.safetensors` checkpoint."""
    index = optional_file(root, INDEX_NAME)
    if index is None:
        if optional_file(root, SINGLE_NAME) is not None:
            return None, None
        raise CheckpointError(f"{root}: no {INDEX_NAME} and no {SINGLE_NAME}")
    data: Any = load_json_file(index, source=INDEX_NAME, what="not valid JSON, truncated or corrupt")
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{INDEX_NAME}: expected an object with a weight_map of tensor name -> shard file")
    for shard in sorted(set(wm.values())):
        shard_path(root, shard)
    return INDEX_NAME, wm


def shard_path(root: Path, name: str) -> Path:
    """Resolve a shard name from the index, refusing anything that leaves the checkpoint directory."""
    if "\0" in name:
        raise CheckpointError(f"{INDEX_NAME}: shard {name!r} is not a valid file name (it holds a NUL byte)")
    return require_file(root, name, f"{show(name)}: shard listed in {INDEX_NAME} is missing", f"{INDEX_NAME}: shard")


def _read_shards(root: Path, weight_map: dict[str, str] | None, index_file: str | None
                 ) -> tuple[dict[str, HfTensor], list[Problem], dict[Path, SafetensorsHeader]]:
    shards = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_NAME]
    tensors: dict[str, HfTensor] = {}
    problems: list[Problem] = []
    headers: dict[Path, SafetensorsHeader] = {}
    for shard in shards:
        path = shard_path(root, shard)
        header = headers[path] = read_header(path)
        for e in header.entries.values():
            if e.name in tensors:
                problems.append(Problem("duplicate", e.name, shard, "stored once",
                                        f"stored twice: in {show(tensors[e.name].file)} and {show(shard)}"))
                continue
            listed = weight_map.get(e.name) if weight_map is not None else shard
            if listed != shard:
                expected = f"in {show(listed)} as {index_file} says" if listed else f"listed in {index_file}"
                problems.append(Problem("index", e.name, shard, expected, f"in {show(shard)}"
                                        + ("" if listed else f", not listed in {index_file}")))
            tensors[e.name] = HfTensor(e.name, e.shape, e.dtype, shard)
    for name, shard in (weight_map or {}).items():
        if name not in tensors:
            problems.append(Problem("index", name, shard, f"in {show(shard)} as {index_file} says",
                                    "absent from every shard"))
    return tensors, problems, headers
