"""The HF files that travel with the weights (generation config, tokenizer, chat template, processors).

Export copies them from `--like`; convert stores the source's in the converted checkpoint (`hf_sidecars/`, each
listed in glmconv.json with its sha256) so that export restores them without `--like`.
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path
from typing import Any

from glmconv.errors import CheckpointError
from glmconv.io.checkpoint_files import optional_file
from glmconv.io.file_names import MANIFEST_NAME, SIDECAR_DIR
from glmconv.io.output import copy_new

FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
         "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
GLOBS = ("chat_template*", "*.tiktoken")
KEY = "sidecars"  # glmconv.json of a converted checkpoint: {name: sha256}


def is_sidecar_name(name: object) -> bool:
    """A plain file name of the kind `find` collects (never a path)."""
    return isinstance(name, str) and "/" not in name and "\0" not in name and name not in (".", "..") and (
        name in FILES or any(fnmatch.fnmatchcase(name, g) for g in GLOBS))


def find(ckpt: Path) -> dict[str, Path]:
    """The checkpoint's sidecar files, each resolved inside it (anything else at such a name is refused)."""
    globbed = sorted({p.name for g in GLOBS for p in ckpt.glob(g)})
    found = {name: optional_file(ckpt, name) for name in (*FILES, *globbed)}
    return {name: path for name, path in found.items() if path is not None}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def store(files: dict[str, Path], stage: Path) -> dict[str, str]:
    """Copy `files` byte for byte into `stage/hf_sidecars/`; their sha256 by name, for glmconv.json."""
    if not files:
        return {}
    (stage / SIDECAR_DIR).mkdir()
    out = {}
    for name, path in sorted(files.items()):
        copy_new(path, stage / SIDECAR_DIR / name)
        out[name] = sha256(stage / SIDECAR_DIR / name)
    return out


def stored(ckpt: Path, listed: Any) -> dict[str, Path]:
    """The sidecars a converted checkpoint's glmconv.json lists, each present, inside it and unchanged."""
    where = ckpt / MANIFEST_NAME
    if not isinstance(listed, dict):
        raise CheckpointError(f"{where}: {KEY} is not a mapping of file names to sha256")
    out = {}
    for name, digest in listed.items():
        if not is_sidecar_name(name):
            raise CheckpointError(f"{where}: {KEY} lists {name!r}, which is not an HF sidecar file name")
        rel = f"{SIDECAR_DIR}/{name}"
        path = optional_file(ckpt, rel)
        if path is None:
            raise CheckpointError(f"{ckpt / rel}: listed in {MANIFEST_NAME} but missing")
        if sha256(path) != digest:
            raise CheckpointError(f"{ckpt / rel}: sha256 differs from the one {MANIFEST_NAME} records; the file "
                                  f"was changed after convert (restore it, or pass --like)")
        out[name] = path
    return out
