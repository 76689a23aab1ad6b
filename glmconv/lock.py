"""An exclusive lock on an output directory, so two glmconv runs can never interleave their writes.

The lock is `fcntl.flock` on `OUT.glmconv-lock`, a file beside OUT (OUT itself is swapped in whole at publish,
and its staging directory is beside it too). The holder's pid is written into the file so the refusal can name
it. The kernel drops a flock when its holder dies (even by SIGKILL), so a lock file left by a killed run holds
nothing: the next run takes it over. The holder removes the file when it is done.

The lock file is opened with O_NOFOLLOW and taken over only when it is a plain, singly linked file holding
nothing or a pid: a symlink, a FIFO, a hard link to another file or a file with other contents at that path
is refused, never truncated.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from types import TracebackType

from glmconv.errors import GlmconvError
from glmconv.text import decimal

LOCK_SUFFIX = ".glmconv-lock"


def lock_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + LOCK_SUFFIX)


class OutputLockedError(GlmconvError):
    """Another live glmconv process holds the lock on this output."""


class OutputLock:
    """`with OutputLock(out):` holds the exclusive lock on OUT for the block; refuses at once if it is taken."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)
        self.path = lock_path(self.out)
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise OutputLockedError naming the holder; never waits."""
        if self._fd is not None:
            raise GlmconvError(f"{self.path}: already held by this process")
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_pid(fd)
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise GlmconvError(f"{self.path}: cannot lock the output ({exc.strerror or exc})") from None
                who = f"pid {holder}" if holder else "pid unknown"
                raise OutputLockedError(f"{self.out} is being written by another glmconv process ({who}); wait "
                                        f"for it or remove {self.path} if that process is gone") from None
            if self._same_file(fd):
                break
            os.close(fd)  # the holder removed the file between our open and our flock: lock the new one
        self._fd = fd
        try:
            _check_takeover(fd, self.path)
            os.ftruncate(fd, 0)
            _write_all(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            self.release()
            raise GlmconvError(f"{self.path}: cannot write the lock file ({exc.strerror or exc})") from None
        except GlmconvError:
            self._fd = None
            os.close(fd)
            raise

    def release(self) -> None:
        """Remove the lock file (still holding the lock, so no one can be between open and flock on it), unlock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._same_file(fd):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)  # closing the last descriptor drops the flock

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            parent = self.path.parent
            if exc.errno == errno.ELOOP:
                raise GlmconvError(f"{self.path}: is a symlink; glmconv never writes through one: remove it"
                                   ) from None
            if not parent.is_dir():
                raise GlmconvError(f"{parent}: output parent directory {not_a_directory(parent)}") from None
            raise GlmconvError(f"{parent}: cannot create the lock file {self.path.name} "
                               f"({exc.strerror or exc}); is the output location writable?") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "a hard link to another file"
            raise GlmconvError(f"{self.path}: is {what}, not glmconv's lock file: remove it")
        return fd

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _check_takeover(fd: int, path: Path) -> None:
    """A lock file left by a killed run holds a pid (or nothing); anything else is a user's file: refuse."""
    text = os.pread(fd, 64, 0)
    if os.fstat(fd).st_size > 32 or not (text.strip() == b"" or text.strip().isdigit()):
        raise GlmconvError(f"{path}: holds something other than a glmconv pid, not glmconv's lock file: "
                           f"remove it")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return decimal(text)


def not_a_directory(path: Path) -> str:
    """Why `path` is no directory, in words (a symlink loop and a dangling link are said as such)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop"
        if exc.errno == errno.ENOENT:
            return "is a symlink to nothing" if os.path.islink(path) else "does not exist"
        return f"cannot be read ({exc.strerror or exc})"
    return "is a directory" if stat.S_ISDIR(st.st_mode) else "is not a directory"
