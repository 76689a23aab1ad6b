"""Where convert and export write, and the one rule for what glmconv may delete: only what it made itself.

Policy (docs/errors.md, "Output directory and interruption"):

* OUT is resolved once, symlinks and `..` included, and every step works on that real directory: a symlink
  OUT (the "output on the big disk" setup) is written through -- the staging directory, the lock and the
  backup sit beside the link's target, the target directory is what gets replaced, the link itself is
  never touched. `.` and `x/..` are the directories they name.
* OUT (and its staging, backup and lock paths) may not be, contain or lie inside any input, after
  resolving: refused before anything is touched.
* An existing OUT is replaced (only with --force, and only at publish) when it is empty or when glmconv
  published it: it holds a `glmconv.json` whose `written_by` is glmconv. Anything else is the user's.
* A directory glmconv will later delete (staging `OUT.glmconv-staging`, backup `OUT.glmconv-old`) gets the
  run marker first, a file beside it (`OUT.glmconv-staging.glmconv-run`) created with O_EXCL, holding pid,
  host and a run id: beside, never inside, so that the directory renamed into OUT's place carries no trace
  of the run whenever the run is killed. A leftover path of that name is removed only when it is a real
  directory whose marker is glmconv's and no live process holds the marker's flock (the run and its workers
  hold it shared for their lifetime); an empty one (a run killed right after mkdir) is removed with rmdir;
  anything else is refused, named. A marker left without its directory (a run killed right after creating it,
  or right after publishing) is removed once unused.
* Every file glmconv creates is opened O_CREAT|O_EXCL|O_NOFOLLOW (`create_new`): never through a symlink,
  never over an existing file. The lock file, which a killed run leaves behind, is opened O_NOFOLLOW and
  taken over only when it is plainly glmconv's (glmconv/lock.py).
* Only the launching process publishes (glmconv/runners/ranks.py): `--workers` children write into the staging
  directory and die with their parent.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from glmconv import interrupt, phases
from glmconv.errors import GlmconvError
from glmconv.io.file_names import MANIFEST_NAME
from glmconv.lock import LOCK_SUFFIX, not_a_directory

STAGING_SUFFIX = ".glmconv-staging"
OLD_SUFFIX = ".glmconv-old"
MARKER = ".glmconv-run"
WRITTEN_BY = "glmconv"
PATH_ROOM = 256  # bytes the deepest file glmconv writes under OUT adds to OUT's path (staging, ranks, shards)
MARKER_MAX_BYTES = 1 << 16  # a marker or manifest is a few hundred bytes; anything larger is not ours
STALE_WAIT_S = 10.0  # how long a leftover staging directory's workers get to die (they follow their parent)
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# ---- files glmconv creates ------------------------------------------------------------------------------

def create_new(path: Path, mode: int = 0o644) -> int:
    """A new file's descriptor: never follows a symlink, never opens what is already there (OSError if so)."""
    return os.open(path, _NEW_FLAGS, mode)


@contextmanager
def new_file(path: Path, mode: str = "wb", buffering: int = -1) -> Iterator[IO[Any]]:
    """`open(path, mode)` for a file glmconv creates (see `create_new`); a failed write leaves no file."""
    fd = create_new(path)
    try:
        with os.fdopen(fd, mode, buffering) as f:
            yield f
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise


def write_new(path: Path, text: str | bytes) -> None:
    """Write a small file glmconv creates (text, or bytes as they are); an OSError (disk full, a link in the way)
    is one error line."""
    try:
        with new_file(path, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
    except OSError as exc:
        raise GlmconvError(f"{path}: cannot write ({_why(exc, path)})") from None


def copy_new(src: Path, dst: Path) -> None:
    """Copy an (already vetted) input file into a file glmconv creates."""
    try:
        with open(src, "rb") as fin, new_file(dst) as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    except OSError as exc:
        raise GlmconvError(f"{dst}: cannot write ({_why(exc, dst)})") from None


def replace_file(path: Path, data: bytes) -> None:
    """Write a file a rerun may replace (a report): a new file beside it, renamed over it, so a symlink at `path`
    is replaced and never followed; a directory or special file there is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise GlmconvError(f"{path}: exists and is not a file")
    tmp = path.with_name(f".{path.name}.glmconv-{os.getpid()}")
    try:
        with new_file(tmp) as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise GlmconvError(f"{path}: cannot write ({_why(exc, path)})") from None


REPORT_FORMAT = "parity-report"


@dataclass(frozen=True)
class ReportClaim:
    """What claiming a report directory made, so that a run that fails leaves nothing it made behind."""

    made: tuple[Path, ...] = ()  # the directories it created, outermost first
    manifest: Path | None = None  # the manifest it wrote: None when the directory was a report directory already

    def undo(self, files: Iterable[Path] = ()) -> None:
        """Remove the report `files`, the manifest and the directories this claim made; nothing of a report directory
        from before, nothing it did not make, no directory that is not empty."""
        if self.manifest is None:
            return
        for f in (*files, self.manifest):
            with suppress(OSError):
                if stat.S_ISREG(os.lstat(f).st_mode):
                    f.unlink()
        for d in reversed(self.made):
            try:
                d.rmdir()
            except OSError:
                return


def claim_report_dir(d: Path, inputs: dict[str, Path | None]) -> ReportClaim:
    """A directory glmconv writes reports into: outside every input; new, empty, or a report directory it wrote
    before (its manifest says so). A converted checkpoint, also glmconv's, is no report directory."""
    real = resolve_out(d)
    for label, given in inputs.items():
        how = _relation(real, real_path(given, label)) if given is not None else None
        if how:
            raise GlmconvError(f"{d}: the report directory {how} the {label} {given}; choose one outside every input")
    if d.exists() and not d.is_dir():
        raise GlmconvError(f"{d}: exists and is not a directory")
    made = tuple(reversed([p for p in (d, *d.parents) if not os.path.lexists(p)]))
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GlmconvError(f"{d}: cannot create the report directory ({_why(exc, d)})") from None
    mine = _small_json(d / MANIFEST_NAME)
    if published_by_glmconv(d) and isinstance(mine, dict) and mine.get("format") == REPORT_FORMAT:
        return ReportClaim()
    if _not_empty(d):
        raise GlmconvError(f"{d}: not empty and not a report directory glmconv wrote; choose a new or empty one")
    manifest = json.dumps({**manifest_fields(), "format": REPORT_FORMAT}, indent=2) + "\n"
    claim = ReportClaim(made, d / MANIFEST_NAME)
    try:
        replace_file(d / MANIFEST_NAME, manifest.encode())
    except GlmconvError:
        claim.undo()
        raise
    return claim


def _why(exc: OSError, path: Path | None = None) -> str:
    if exc.errno == errno.ELOOP or exc.errno == errno.EEXIST and path is not None and path.is_symlink():
        return "a symlink is in the way; glmconv never writes through one"
    if exc.errno == errno.EEXIST:
        return "something is already there; glmconv never writes over a file it did not create"
    return exc.strerror or str(exc)


# ---- where OUT is -----------------------------------------------------------------------------------

def real_path(path: Path, what: str) -> Path:
    """`path` with every symlink and `..` resolved (the part that exists; the rest taken as written)."""
    try:
        return Path(os.path.realpath(path, strict=False))
    except (OSError, RuntimeError, ValueError) as exc:
        raise GlmconvError(f"{path}: cannot resolve the {what} ({exc})") from None


def sibling(real_out: Path, suffix: str) -> Path:
    return real_out.with_name(real_out.name + suffix)


def resolve_out(out: Path) -> Path:
    """The real directory OUT names; the filesystem root has no place beside it for staging, so refused."""
    real = real_path(out, "output directory")
    if real.parent == real:
        raise GlmconvError(f"{out}: cannot write the output over the filesystem root; name a directory below it")
    _check_length(out, real)
    return real


def _check_length(out: Path, real: Path) -> None:
    """Refuse an OUT whose own name, or the names glmconv makes beside and below it, the filesystem cannot hold."""
    name_max, path_max = _limits(real)
    longest = max(len(s) for s in (STAGING_SUFFIX, OLD_SUFFIX, LOCK_SUFFIX))
    long_part = next((p for p in real.parts if len(os.fsencode(p)) > name_max), None)
    if long_part is not None or len(os.fsencode(real.name)) + longest > name_max:
        raise GlmconvError(f"{printable_head(out)}: a path component is longer than the filesystem's {name_max} bytes "
                           f"(glmconv adds up to {longest} to OUT's name); choose a shorter OUT")
    if len(os.fsencode(real)) + longest + PATH_ROOM > path_max:
        raise GlmconvError(f"{printable_head(out)}: the path is {len(os.fsencode(real)):,} bytes; the files glmconv "
                           f"writes below it need it under {path_max - longest - PATH_ROOM:,}; choose a shorter OUT")


def printable_head(path: Path, keep: int = 80) -> str:
    """A long path shortened for one error line: its first `keep` characters, then how much was left out."""
    text = str(path)
    return text if len(text) <= keep else f"{text[:keep]}... ({len(text):,} characters)"


def _limits(real: Path) -> tuple[int, int]:
    """NAME_MAX and PATH_MAX where OUT would be (its nearest existing ancestor), POSIX's usual values if unknown."""
    here = real
    while not os.path.isdir(here) and here.parent != here:  # isdir: False for a name too long, never raises
        here = here.parent
    try:
        return os.pathconf(here, "PC_NAME_MAX"), os.pathconf(here, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def check_overlap(out: Path, inputs: dict[str, Path | None]) -> Path:
    """Refuse OUT (or its staging, backup, lock) being, containing or lying inside an input; the real OUT."""
    real = resolve_out(out)
    ours = [real] + [sibling(real, s) for s in (STAGING_SUFFIX, OLD_SUFFIX, LOCK_SUFFIX)]
    for label, given in inputs.items():
        if given is None:
            continue
        src = real_path(given, label)
        for p in ours:
            how = _relation(p, src)
            if how:
                where = "OUT" if p == real else f"OUT's {p.name[len(real.name) + 1:]} path {p}"
                raise GlmconvError(f"{out}: {where} {how} the {label} {given}; choose an output directory "
                                   f"outside every input")
    return real


def _relation(p: Path, src: Path) -> str | None:
    """How `p` overlaps `src` (both resolved), by path and, for what exists, by inode (bind mounts)."""
    if _same(p, src):
        return "is the same path as"
    if any(_same(a, src) for a in p.parents):
        return "is inside"
    if any(_same(p, a) for a in src.parents):
        return "contains"
    return None


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_target(out: Path, real: Path, force: bool) -> None:
    """Refuse an OUT that may not be replaced; never touches it (publish replaces it whole, at the end)."""
    if os.path.lexists(real) and not real.is_dir():
        raise GlmconvError(f"{out}: exists and is not a directory")
    if real.is_dir() and _not_empty(real):
        if not published_by_glmconv(real):  # --force is refused here too: never suggested
            tried = "; --force replaces only a directory glmconv published" if force else ""
            raise GlmconvError(f"{out}: already exists and is not empty, and glmconv did not publish it (no "
                               f"{MANIFEST_NAME} written by glmconv){tried}: choose another OUT, or empty it")
        if not force:
            raise GlmconvError(f"{out}: already exists and is not empty; pass --force to replace it")
    parent = real.parent
    if not parent.is_dir():
        raise GlmconvError(f"{parent}: output parent directory {not_a_directory(parent)}")
    if not os.access(parent, os.W_OK):
        raise GlmconvError(f"{parent}: not writable")
    if real.is_dir() and os.stat(real).st_dev != os.stat(parent).st_dev:
        raise GlmconvError(f"{out}: is a mount point; glmconv stages beside OUT and renames it into place, which "
                           f"cannot cross filesystems: name a directory inside it, e.g. {real / 'ckpt'}")


def _not_empty(d: Path) -> bool:
    try:
        with os.scandir(d) as it:
            return any(True for _ in it)
    except OSError as exc:
        raise GlmconvError(f"{d}: cannot list the output directory ({exc.strerror or exc})") from None


def published_by_glmconv(d: Path) -> bool:
    """`d` holds the manifest glmconv writes last before publishing (a plain file, `written_by` glmconv)."""
    data = _small_json(d / MANIFEST_NAME)
    return isinstance(data, dict) and data.get("written_by") == WRITTEN_BY


def manifest_fields() -> dict[str, str]:
    """What every published manifest carries, so that --force can tell glmconv's directories from others."""
    return {"written_by": WRITTEN_BY}


def _small_json(path: Path) -> Any:
    """A small JSON file read without following a symlink; None when absent, odd, too big or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MARKER_MAX_BYTES:
            return None
        return json.loads(os.pread(fd, MARKER_MAX_BYTES, 0).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


# ---- directories glmconv will delete: the run marker ------------------------------------------------------

@dataclass
class Stage:
    """A staging directory this run made; `fd` is its marker, flocked shared for the run's lifetime."""

    path: Path
    run: str
    fd: int

    @property
    def marker(self) -> Path:
        return marker_of(self.path)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def marker_of(d: Path) -> Path:
    """Where the run marker of a directory glmconv will delete lies: beside it (`D.glmconv-run`)."""
    return d.with_name(d.name + MARKER)


def open_stage(real_out: Path) -> Stage:
    """A fresh `OUT.glmconv-staging`, its marker written first; a leftover one is removed only if ours."""
    path = sibling(real_out, STAGING_SUFFIX)
    remove_ours(path, "staging")
    run = uuid.uuid4().hex
    fd = _write_marker(path, "staging", run)
    try:
        os.mkdir(path, 0o755)
    except OSError as exc:
        os.close(fd)
        marker_of(path).unlink(missing_ok=True)
        raise GlmconvError(f"{path}: cannot create the staging directory ({exc.strerror or exc})") from None
    return Stage(path, run, fd)


def _write_marker(d: Path, state: str, run: str) -> int:
    """Create `d`'s marker (O_EXCL), flock it shared and keep it open: the directory is ours and in use."""
    path = marker_of(d)
    body = json.dumps({"written_by": WRITTEN_BY, "state": state, "run": run, "pid": os.getpid(),
                       "host": socket.gethostname(), "started": time.time()}) + "\n"
    try:
        fd = create_new(path)
    except OSError as exc:
        raise GlmconvError(f"{path}: cannot create the run marker ({_why(exc, path)})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        _write_all(fd, body.encode())
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise GlmconvError(f"{path}: cannot write the run marker ({exc.strerror or exc})") from None
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def join_stage(path: Path, run: str) -> int:
    """A worker's hold on its run's staging directory: the marker flocked shared, the run id checked.

    Returns the descriptor to keep open for the worker's lifetime. A staging directory that is no longer
    this run's (a rerun replaced it after this worker's parent died) is refused: the worker writes nothing.
    """
    try:
        fd = os.open(marker_of(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise GlmconvError(f"{path}: staging directory is gone ({exc.strerror or exc}); nothing written") from None
    fcntl.flock(fd, fcntl.LOCK_SH)
    data = _small_json(marker_of(path))
    if not isinstance(data, dict) or data.get("run") != run:
        os.close(fd)
        raise GlmconvError(f"{path}: staging directory belongs to another run; nothing written")
    return fd


def remove_ours(path: Path, what: str, keep: bool = False) -> None:
    """Delete a leftover staging/backup directory if glmconv made it and nothing uses it; else refuse.

    With `keep`, only the checks: the caller moves the directory instead.
    """
    marker = marker_of(path)
    if not os.path.lexists(path):
        _drop_marker(marker, path)
        return
    if path.is_symlink() or not path.is_dir():
        kind = "a symlink" if path.is_symlink() else "not a directory"
        raise GlmconvError(f"{path}: in the way of glmconv's {what} directory and not made by glmconv ({kind}); "
                           f"remove it yourself")
    data = _small_json(marker)
    if not isinstance(data, dict) and not keep and _rmdir_if_empty(path):
        return  # a run killed between mkdir and its marker: an empty directory loses nothing
    if not isinstance(data, dict) or data.get("written_by") != WRITTEN_BY:
        raise GlmconvError(f"{path}: in the way of glmconv's {what} directory and not made by glmconv (no "
                           f"{MARKER} marker); remove or rename it yourself")
    _refuse_if_used(marker, path, data)
    if keep:
        return
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise GlmconvError(f"{path}: cannot remove the leftover {what} directory ({exc.strerror or exc})") from None
    marker.unlink(missing_ok=True)


def _refuse_if_used(marker: Path, path: Path, data: dict[str, Any]) -> None:
    if not _wait_unused(marker):
        raise GlmconvError(f"{path}: left by glmconv pid {data.get('pid')} on {data.get('host')}, which still "
                           f"uses it; wait for that process to end")


def _drop_marker(marker: Path, path: Path) -> None:
    """Remove a marker whose directory is gone (killed right after creating it, or right after publishing),
    once no process uses it; a file of that name glmconv did not write is left alone (an empty one is the
    marker of a run killed between creating and writing it: it holds nothing to lose)."""
    data = _small_json(marker)
    if isinstance(data, dict) and data.get("written_by") == WRITTEN_BY or _empty_file(marker):
        _refuse_if_used(marker, path, data if isinstance(data, dict) else {})
        marker.unlink(missing_ok=True)


def _empty_file(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def _rmdir_if_empty(path: Path) -> bool:
    try:
        os.rmdir(path)  # the kernel refuses unless empty: nothing of anyone's can go
    except OSError:
        return False
    return True


def _wait_unused(marker: Path) -> bool:
    """True once no process holds the marker's flock (waits a little: orphaned workers die with their parent)."""
    wait_s = STALE_WAIT_S
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    finally:
        os.close(fd)


def discard(stage: Stage) -> None:
    """Remove this run's staging directory (best effort: failing here must not hide the real error)."""
    stage.close()
    data = _small_json(stage.marker)
    if not isinstance(data, dict) or data.get("run") != stage.run:
        return
    if os.path.lexists(stage.path) and not stage.path.is_symlink():
        shutil.rmtree(stage.path, ignore_errors=True)
    stage.marker.unlink(missing_ok=True)


# ---- publishing --------------------------------------------------------------------------------------

def publish(stage: Stage, out: Path, real: Path, force: bool) -> None:
    """Swap the verified staging directory into OUT's place; an old OUT glmconv published goes only now.

    An empty OUT is replaced by one rename (rename(2) may replace an empty directory). A non-empty one is
    checked again, marked as ours, moved to `OUT.glmconv-old`, then deleted once the new OUT is in place;
    if the new one cannot be moved in, the old one is moved back. SIGINT/SIGTERM from here on are too late
    (`interrupt.completing`): the run either publishes and succeeds or fails with the previous OUT intact.
    """
    fsync, start = phases.peek("fsync"), time.monotonic()
    with interrupt.completing():
        _publish(stage, out, real, force)
    phases.add("publish", time.monotonic() - start - (phases.peek("fsync") - fsync))  # fsync apart


def _publish(stage: Stage, out: Path, real: Path, force: bool) -> None:
    check_target(out, real, force)
    try:
        with phases.timed("fsync"):
            sync_tree(stage.path)  # on disk before the name says so: a crash never leaves a complete-looking OUT torn
        old = _set_aside(real, stage.run) if real.is_dir() and _not_empty(real) else None
        try:
            os.rename(stage.path, real)
        except OSError:
            if old is not None:
                _put_back(old, real)
            raise
        _fsync_fd_of(real.parent, os.O_DIRECTORY)  # the rename itself
    except OSError as exc:
        raise GlmconvError(f"{out}: cannot publish ({exc.strerror or exc}); the previous OUT is unchanged"
                           ) from None
    finally:
        stage.close()
    stage.marker.unlink(missing_ok=True)
    if old is not None:
        discard(old)


def sync_tree(root: Path) -> None:
    """fsync every regular file and directory below `root` (symlinks are not followed); files already flushed
    (convert's data files, fsynced as each is finished) cost nothing more."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            sync_tree(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            _fsync_fd_of(Path(entry.path), 0)
    _fsync_fd_of(root, os.O_DIRECTORY)


def _fsync_fd_of(path: Path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(real: Path) -> None:
    """Finish what a run killed inside `publish` left (call under the lock), so OUT is whole again.

    Killed between the two renames, OUT is absent and the old OUT waits as our backup: it is moved back (the
    interrupted run published nothing). Killed after them, the backup is the replaced OUT: it is removed.
    """
    old = sibling(real, OLD_SUFFIX)
    if not os.path.lexists(old):
        _drop_marker(marker_of(old), old)
        return
    if os.path.lexists(real):
        remove_ours(old, "backup")
        return
    remove_ours(old, "backup", keep=True)  # refuses unless ours and unused
    try:
        os.rename(old, real)
    except OSError as exc:
        raise GlmconvError(f"{old}: cannot move the previous OUT back ({exc.strerror or exc})") from None
    marker_of(old).unlink(missing_ok=True)


def _set_aside(real: Path, run: str) -> Stage:
    """Mark the old OUT as ours (a crash then leaves a backup the next run recognises), move it aside."""
    old_path = sibling(real, OLD_SUFFIX)
    remove_ours(old_path, "backup")
    leftover = real / MARKER
    if os.path.lexists(leftover) and isinstance(_small_json(leftover), dict):
        leftover.unlink()  # a crashed publish left its marker in this (published) OUT
    old = Stage(old_path, run, _write_marker(old_path, "old", run))
    try:
        os.rename(real, old_path)
    except OSError:
        old.close()
        old.marker.unlink(missing_ok=True)
        raise
    return old


def _put_back(old: Stage, real: Path) -> None:
    old.close()
    os.rename(old.path, real)
    old.marker.unlink(missing_ok=True)
