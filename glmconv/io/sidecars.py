"""The HF files that travel with the weights (generation config, tokenizer, chat template, processors).

Export copies them from `--like`; convert stores the source's in the converted checkpoint (`hf_sidecars/`, each
listed in glmconv.json with its sha256) so that export restores them without `--like`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
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
TEMPLATES_DIR = "chat_templates"  # transformers' folder of named chat templates (`chat_templates/NAME.jinja`)
KEY = "sidecars"  # glmconv.json of a converted checkpoint: {name: sha256}


def is_sidecar_name(name: object) -> bool:
    """A plain file name of the kind `find` collects, or `chat_templates/NAME` (no other path)."""
    if not isinstance(name, str):
        return False
    head, _, rest = name.rpartition("/")
    if head:
        return head == TEMPLATES_DIR and _plain(rest)
    return _plain(name) and name != TEMPLATES_DIR and (
        name in FILES or any(fnmatch.fnmatchcase(name, g) for g in GLOBS))


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


def find(ckpt: Path) -> dict[str, Path]:
    """The checkpoint's sidecar files, each resolved inside it (anything else at such a name is refused), with
    the files of its `chat_templates/` folder."""
    globbed = sorted({p.name for g in GLOBS for p in ckpt.glob(g) if p.name != TEMPLATES_DIR})
    names = [*FILES, *globbed, *_templates(ckpt)]
    found = {name: optional_file(ckpt, name) for name in names}
    return {name: path for name, path in found.items() if path is not None}


def _templates(ckpt: Path) -> list[str]:
    """`chat_templates/NAME` of each entry of that folder, when the checkpoint has one (a file there is refused)."""
    folder = ckpt / TEMPLATES_DIR
    if not os.path.lexists(folder):
        return []
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory; transformers keeps named chat templates in one")
    return sorted(f"{TEMPLATES_DIR}/{p.name}" for p in folder.iterdir())


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
        copy_into(path, stage / SIDECAR_DIR, name)
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


def copy_into(path: Path, folder: Path, name: str) -> None:
    """Copy a sidecar to `folder/name`, making its `chat_templates/` folder first where it has one."""
    target = folder / name
    if target.parent != folder and not target.parent.is_dir():
        target.parent.mkdir()
    copy_new(path, target)
