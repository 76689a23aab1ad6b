"""Reading and dequantising ahead of the writer: steps run on a few threads, their chunks come back in order.

The writer consumes chunks one at a time on the calling thread; a small pool makes the next ones meanwhile
(pread and torch's kernels release the GIL). Chunks come out in exactly the order of the steps, so the data
files are byte for byte those of the serial path. Memory: the steps submitted and not yet handed to the
writer hold at most `ahead_bytes` (counted by each step's stated `nbytes`; a single larger step runs alone).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, NoReturn, TypeVar

from glmconv.defaults import DEFAULT_AHEAD_BYTES, DEFAULT_THREADS

MAX_STEPS_AHEAD = 64  # steps that hold no memory (file-to-file copies) still queue no further than this
T = TypeVar("T")  # what a step makes: a chunk, a (name, tensor) pair, a comparison


@dataclass(frozen=True)
class Step(Generic[T]):
    """Work that makes some chunks, in order; `nbytes`: the memory they hold until written (0: none)."""

    nbytes: int
    make: Callable[[], Sequence[T]]


def run_ahead(steps: Iterable[Step[T]], threads: int = DEFAULT_THREADS,
              ahead_bytes: int = DEFAULT_AHEAD_BYTES) -> Generator[T, None, None]:
    """The chunks of `steps`, in order, made on `threads` threads (0: here, one step at a time)."""
    if threads < 1:
        for step in steps:
            yield from step.make()
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="glmconv-read")
    pending: deque[tuple[int, Future[Sequence[T]]]] = deque()
    held = 0
    upcoming = iter(steps)
    nxt = _next(upcoming)
    try:
        while nxt is not None or pending:
            while nxt is not None and len(pending) < MAX_STEPS_AHEAD and (
                    not pending or held + nxt.nbytes <= ahead_bytes):
                pending.append((nxt.nbytes, pool.submit(nxt.make)))
                held += nxt.nbytes
                nxt = _next(upcoming)
            nbytes, made = pending.popleft()
            chunks = made.result()
            held -= nbytes
            yield from chunks
    finally:
        for _, made in pending:
            made.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


def _next(upcoming: Iterator[Step[T]]) -> Step[T] | None:
    """The next step; one that could not even be described fails in its place, after the steps before it (as
    the serial path would fail there), and ends the steps."""
    try:
        return next(upcoming, None)
    except Exception as exc:
        return _failing(exc)  # `exc` itself is unbound once the block ends


def _failing(exc: Exception) -> Step[T]:
    """A step that raises `exc` where the serial path would have."""
    return Step(0, lambda: _raise(exc))


def _raise(exc: Exception) -> NoReturn:
    raise exc
