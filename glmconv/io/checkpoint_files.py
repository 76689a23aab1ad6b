"""The one rule for every file glmconv reads from a checkpoint directory (HF or torch_dist).

A checkpoint can come from anywhere (a cloned repository may hold symlinks), and what glmconv reads may be
copied into an output the user then publishes. So a file is read only when, after following symlinks, it is
a regular file inside the checkpoint directory. Symlinks that stay inside are followed, and so is the
Hugging Face hub cache layout (`snapshots/REV/NAME -> ../../blobs/HASH`), whose targets stay inside the
cached repository's `blobs/`. The checkpoint directory itself may be a symlink (output on a big disk).
A link leaving the directory, a FIFO, a device or a directory where a file belongs is refused, naming it.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from pathlib import Path, PurePosixPath

from glmconv.errors import CheckpointError
from glmconv.io.file_names import CONFIG_NAME, TRACKER_NAME

HF_CACHE_SNAPSHOTS = "snapshots"
HF_CACHE_BLOBS = "blobs"


def check_checkpoint_dir(path: Path) -> Path:
    """`path` as a directory (following a symlink to it), or one line saying what it is instead."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such directory") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise not_a_directory(path, st.st_mode)
    return path


def expect_directory(path: str | Path) -> None:
    """Refuse a file (a shard, the index, config.json, a .distcp, .metadata) given where a checkpoint directory
    goes, naming the directory holding it; a missing path is left to the reader that names what is missing."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    if not stat.S_ISDIR(st.st_mode):
        raise not_a_directory(Path(path), st.st_mode)


def not_a_directory(path: Path, mode: int, expected: str = "a checkpoint directory") -> CheckpointError:
    """`path` (of stat `mode`) where a checkpoint directory goes: what it is, what goes there and, for a file of
    a checkpoint, the directory to pass instead."""
    return CheckpointError(f"{path}: not a directory ({file_kind(mode)}); expected {expected}"
                           f"{holding_hint(path)}")


def holding_hint(path: Path) -> str:
    """` (it is a file of the checkpoint directory D: pass D)` when `path` lies in one (a shard, the index,
    config.json, an iteration directory's .distcp or .metadata), else ``."""
    holder = enclosing_checkpoint(path)
    return f" (it is a file of the checkpoint directory {holder}: pass {holder})" if holder is not None else ""


def enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint directory `path` is a file of: the nearest of its three parents holding an HF config.json
    or a torch_dist tracker (the root of `release/__0_0.distcp`, not its iteration directory)."""
    for d in list(path.parents)[:3]:
        if (d / CONFIG_NAME).is_file() or (d / TRACKER_NAME).is_file():
            return d
    return None


def allowed_roots(root: Path) -> tuple[Path, ...]:
    """The resolved directory, plus the hub cache's `blobs/` when `root` is a cache snapshot."""
    real = resolved(root, f"{root}:")
    blobs = real.parent.parent / HF_CACHE_BLOBS
    if real.parent.name == HF_CACHE_SNAPSHOTS and blobs.is_dir():
        return real, resolved(blobs, f"{blobs}:")
    return (real,)


def inside(root: Path, rel: str, label: str | None = None) -> Path:
    """`root / rel` resolved, refused when `rel` or a symlink on the way leads outside the checkpoint."""
    what = f"{label} {rel!r}" if label else f"{root / rel}:"
    pure = PurePosixPath(rel)
    if not rel or "\0" in rel or "\\" in rel:
        raise CheckpointError(f"{what} is not a file name (empty, or holding a NUL or a backslash)")
    if pure.is_absolute():
        raise CheckpointError(f"{what} is outside the checkpoint directory")
    if ".." in pure.parts:  # refused even where it stays inside: said as it is
        if posixpath.normpath(rel).split("/")[0] == "..":
            raise CheckpointError(f"{what} is outside the checkpoint directory")
        raise CheckpointError(f"{what} has a '..' component (it names a file inside, but glmconv takes no '..')")
    real = resolved(root / rel, what)
    if not any(real.is_relative_to(a) for a in allowed_roots(root)):
        raise CheckpointError(f"{what} resolves to {real}, outside the checkpoint directory")
    return real


def resolved(path: Path, what: str) -> Path:
    """`path` with its symlinks followed; a symlink loop (or a path the system cannot resolve) is the user's input."""
    try:
        return path.resolve()
    except RuntimeError:  # Python before 3.13 reports a symlink loop this way
        raise CheckpointError(f"{what} is a symlink loop") from None
    except OSError as exc:
        why = "is a symlink loop" if exc.errno == errno.ELOOP else f"cannot be resolved ({exc.strerror or exc})"
        raise CheckpointError(f"{what} {why}") from None


def optional_file(root: Path, rel: str, label: str | None = None) -> Path | None:
    """The resolved regular file `root / rel`, None when absent; anything else at that name is refused."""
    real = inside(root, rel, label)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{root / rel}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{root / rel}: not a regular file ({file_kind(st.st_mode)})")
    return real


def require_file(root: Path, rel: str, missing: str, label: str | None = None) -> Path:
    """Like `optional_file`, with `missing` as the error when the file is absent."""
    found = optional_file(root, rel, label)
    if found is None:
        raise CheckpointError(missing)
    return found


def file_kind(mode: int) -> str:
    """What a stat mode is, in words."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file"))
    return next((word for test, word in kinds if test(mode)), "a special file")
