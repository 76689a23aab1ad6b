"""What every plan runner (convert, export) shares: one output path, and running as 1, N or torchrun ranks.

A runner's rank function has the signature `fn(*args, stage, rank, world, group)`; `run_on_output` checks
OUT (glmconv/io/output.py), makes the staging directory, calls it through `run_ranks` in this process, in
`workers` spawned gloo processes, or once per torchrun rank, and publishes rank 0's result itself.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from multiprocessing import popen_spawn_posix, reduction, resource_tracker
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext, SpawnProcess, set_spawning_popen
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, TypeVar, cast

from glmconv import interrupt, phases
from glmconv.errors import GlmconvError
from glmconv.io import output
from glmconv.io.output import STAGING_SUFFIX
from glmconv.lock import OutputLock
from glmconv.numerics.dequant import cpu_count, torch_threads
from glmconv.progress import Progress

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Group: TypeAlias = "ProcessGroup | None"  # the ranks' gloo group; None: one rank, in this process

T = TypeVar("T")  # a value that travels between ranks
S = TypeVar("S")  # what a rank function returns: rank 0's summary (a dict)
RankFn = Callable[..., S]  # `fn(*args, rank, world, group)`: the arguments differ per runner
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_HELD: list[int] = []  # a worker's flocked staging marker
_EXIT: dict[str, bool] = {"cli": False, "group_open": False}  # see `cli_ends_the_process` and `leave_now`
ARRIVED_KEY = "glmconv/ranks-past-collectives"
ARRIVAL_TIMEOUT_S = 300.0
DEATH_POLL_S = 0.2  # how often the launching process looks for a dead worker while it waits for outcomes


# ---- staging and publishing: glmconv/io/output.py ----------------------------------------------------------

def staging_dir(out: Path) -> Path:
    """Where OUT's staging directory is: beside the real OUT (a symlink OUT is written through)."""
    return output.sibling(output.resolve_out(out), STAGING_SUFFIX)


# ---- errors that every rank must see -----------------------------------------------------------------

def try_(fn: Callable[[], T]) -> T | str:
    """Run `fn`; a user-facing error becomes its message (so every rank still reaches the collectives)."""
    try:
        return fn()
    except GlmconvError as exc:
        return str(exc)


def try_none(fn: Callable[[], object]) -> str | None:
    out = try_(fn)
    return out if isinstance(out, str) else None


def gather(group: Group, value: T, world: int) -> list[T]:
    """Every rank's `value`, in rank order, on every rank."""
    if group is None:
        return [value]
    import torch.distributed as dist

    out: list[object] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return cast("list[T]", out)  # every slot now holds a rank's `value`


def broadcast(group: Group, value: T) -> T:
    """Rank 0's `value`, seen by every rank."""
    if group is None:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def collective_error(group: Group, error: str | None) -> str | None:
    """Rank 0's verdict, seen by every rank."""
    return broadcast(group, error)


def progress(label: str, total: int, items: int, enabled: bool, noun: str = "tensors") -> Progress:
    return Progress(label, total, items, enabled=enabled, noun=noun)


# ---- running: one process, --workers N, or torchrun ranks ---------------------------------------------

def rank_label(verb: str, rank: int, world: int) -> str:
    """A progress line's label: the verb, with the node and rank where there are several (`export [node 1, rank
    3/4]`: torchrun's GROUP_RANK; `export [2/4]` for --workers)."""
    if world <= 1:
        return verb
    node = os.environ.get("GROUP_RANK") if torchrun_env() is not None else None
    return f"{verb} [node {node}, rank {rank}/{world}]" if node is not None else f"{verb} [{rank}/{world}]"


def progress_here(rank: int) -> bool:
    """Whether this rank shows progress: rank 0 of --workers, and under torchrun the first rank of each node
    (LOCAL_RANK 0), so that every node's log has its own line."""
    if torchrun_env() is not None:
        return os.environ.get("LOCAL_RANK", str(rank)) == "0"
    return rank == 0


def cores_per_rank(world: int) -> int:
    """This rank's share of its machine's cores: those of the process over the ranks on this machine (torchrun's
    LOCAL_WORLD_SIZE, else the `world` of --workers)."""
    here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torchrun_env() is not None else world
    return max(1, cpu_count() // max(1, here))


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ["RANK"]), world) if world > 1 and "RANK" in os.environ else None


def run_on_output(out: Path, inputs: dict[str, Path | None], force: bool, fn: RankFn[S], args: tuple[object, ...],
                  workers: int, what: str, space_check: Callable[[], object] | None = None,
                  on_publish: Callable[[], None] | None = None) -> S:
    """Check OUT against the inputs, then stage, run every rank and publish, holding OUT's exclusive lock.

    `space_check` (glmconv/space.py) runs once OUT is known to be writable, before anything is written;
    `on_publish` (progress) just before the staging directory is renamed into place.

    `fn(*args, stage, rank, world, group)` writes into `stage` and never publishes: the launching process
    does, once every rank is done (under torchrun, rank 0, which also takes the lock; a refusal there ends
    the job). Any failure or SIGINT/SIGTERM removes the staging directory and releases the lock.
    """

    real = output.check_overlap(out, inputs)
    output.check_target(out, real, force)
    if space_check is not None:
        space_check()  # refuses an output that cannot fit: nothing written yet
    env = torchrun_env()
    lead = env is None or env[0] == 0
    with interrupt.catching():
        try:
            with OutputLock(real) if lead else nullcontext():
                if lead:
                    output.recover(real)  # a run killed inside publish: its old OUT is put back first
                output.check_target(out, real, force)  # again, under the lock: another run may have published
                return _run_staged(out, real, force, fn, args, workers, what, on_publish)
        except BaseException as exc:
            really = interrupt.as_interrupt(exc)
            if really is exc:
                raise
            raise really from None


def _run_staged(out: Path, real: Path, force: bool, fn: RankFn[S], args: tuple[object, ...], workers: int,
                what: str, on_publish: Callable[[], None] | None = None) -> S:
    """The lead makes the staging directory, runs the ranks, publishes; on any failure it discards the stage."""
    env = torchrun_env()
    stage = output.open_stage(real) if env is None or env[0] == 0 else None
    try:
        summary = run_ranks(fn, (*args, output.sibling(real, STAGING_SUFFIX)), workers, what, stage)
        if stage is not None:
            if on_publish is not None:
                on_publish()
            output.publish(stage, out, real, force)
        return summary
    except BaseException:
        if stage is not None:
            output.discard(stage)
        raise


def run_ranks(fn: RankFn[S], args: tuple[object, ...], workers: int, what: str,
              stage: output.Stage | None = None) -> S:
    """`fn(*args, rank, world, group)` under torchrun, in `workers` processes, or here; rank 0's summary."""
    env = torchrun_env()
    if env is not None:
        return _torchrun_rank(fn, args, env[0], env[1])
    if workers > 1:
        return spawn(fn, args, workers, what, stage)
    return fn(*args, 0, 1, None)


def cli_ends_the_process() -> None:
    """The command line calls this first: under torchrun its process then ends through `leave_now`, never
    tearing the gloo group down (see `_torchrun_rank`)."""
    _EXIT["cli"] = True


def leave_now(code: int) -> None:
    """End this process at once (output already flushed) when a torchrun rank left its gloo group open."""
    if _EXIT["group_open"]:
        os._exit(code)


def _torchrun_rank(fn: RankFn[S], args: tuple[object, ...], rank: int, world: int) -> S:
    """One torchrun rank. A gloo group torn down (destroy, or the interpreter's exit) while a peer tears its
    own down aborts a rank now and then ("terminate called without an active exception"): once every rank is
    past its last collective (counted on torchrun's store, which outlives the ranks), the command line's
    process leaves with `os._exit` and no teardown; a Python caller's group is destroyed as before."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        with torch_threads(cores_per_rank(world)):  # torchrun sets OMP_NUM_THREADS=1: the node's cores shared out
            result = _then_barrier(fn(*args, rank, world, dist.group.WORLD))
        _all_past_collectives(world)
    except BaseException:
        dist.destroy_process_group()
        raise
    if _EXIT["cli"]:
        _EXIT["group_open"] = True
    else:
        dist.destroy_process_group()
    return result


def _all_past_collectives(world: int) -> None:
    """Wait until every rank has counted itself on the store: none of them is in a gloo collective any more."""

    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    store.add(ARRIVED_KEY, 1)
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while store.add(ARRIVED_KEY, 0) < world:
        if time.monotonic() > deadline:
            raise GlmconvError(f"a torchrun rank did not finish within {ARRIVAL_TIMEOUT_S:.0f} s of the others")
        time.sleep(0.01)


def _then_barrier(result: T) -> T:
    """`result`, once every rank has it: no rank tears the gloo group down while a peer is still in a collective
    (seen under torchrun: a rank that exits early makes its peer's gloo thread abort in destroy_process_group)."""
    import torch.distributed as dist

    dist.barrier()
    return result


def spawn(fn: RankFn[S], args: tuple[object, ...], workers: int, what: str,
          stage: output.Stage | None = None) -> S:
    """--workers N on one machine: N gloo processes, each running its rank of `fn`.

    The workers die with this process (`_bind_to_parent`) and, on any failure or interruption here, are
    killed and reaped before the caller removes the staging directory they write into.
    """

    hold = (stage.path, stage.run) if stage is not None else None
    with tempfile.TemporaryDirectory(prefix="glmconv-pg-") as tmp:
        ctx = mp.get_context("spawn")
        links = [_Link(ctx) for _ in range(workers)]
        procs: list[SpawnProcess] = [
            _WorkerProcess(target=_worker, args=(fn, args, r, workers, Path(tmp) / "store", link.out_send,
                                                 os.getpid(), hold, link.done_recv))
            for r, link in enumerate(links)]
        try:
            with _sigint_ignored_by_children(), _tracker_relaunch_quiet():
                for p, link in zip(procs, links):
                    p.start()
                    link.started()
            outcomes, died = _collect(links, procs)
        except BaseException:
            _kill(procs)
            raise
        finally:
            for link in links:
                link.close()
    dead = died or [f"rank {r} {_how(p.exitcode)}" for r, p in enumerate(procs) if p.exitcode]
    if dead:  # first: the survivors' errors are only the echo of a lost peer
        raise GlmconvError(f"a {what} worker died ({', '.join(dead)}); nothing published")
    errors = [o for o in outcomes if isinstance(o, str)]
    if errors:
        raise GlmconvError(errors[0])
    if not any(isinstance(o, dict) for o in outcomes):
        raise GlmconvError(f"no {what} worker reported a result; nothing published")
    return cast("S", next(o for o in outcomes if isinstance(o, dict)))  # not a message: what `fn` returned


@contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """Start children with SIGINT ignored (SIG_IGN survives exec, a handler does not).

    Ctrl-C reaches the whole process group; a worker still importing torch would print a KeyboardInterrupt
    traceback. The parent alone handles it, and kills the workers.
    """

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@contextmanager
def _tracker_relaunch_quiet() -> Iterator[None]:
    """Starting a worker relaunches a killed resource tracker with a UserWarning that resources might leak;
    the workers' pipes register none (`_Link`), so nothing can: the warning is not shown."""

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="resource_tracker: process died unexpectedly")
        yield


# What a worker's interpreter runs (`python -c`): multiprocessing's own spawn_main, the child bound to the parent's
# life first, its start-up data (`pipe_handle`) a file complete before it starts. spawn_main takes a dup of that
# handle as the child's view of its parent (`multiprocessing.parent_process()`, which glmconv never asks):
# the workers watch the parent with PR_SET_PDEATHSIG and getppid (`_bind_to_parent`).
_WORKER_PROGRAM = """\
# glmconv --workers rank: multiprocessing.spawn_main, reading its start-up data from a file
import os
try:
    import ctypes
    ctypes.CDLL(None).prctl({pdeathsig}, {sigkill}, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != {parent}:
    os._exit(1)
from multiprocessing.spawn import spawn_main
spawn_main(tracker_fd={tracker}, pipe_handle={data})
"""


class _WorkerPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn start, except how the start-up data reaches the child.

    multiprocessing (popen_spawn_posix.Popen._launch) pickles the process object (fn and the run's arguments:
    100-300 kB for convert, export and verify of the test fixtures, more for bigger models) and writes it into a
    pipe once the child runs, closing its own copy of the pipe's read end only after the write. More than the
    pipe holds (64 kB) blocks until the child reads: a child killed before it has read it all left that write,
    the parent's main thread, blocked forever (the child a zombie); a parent killed in that write left the
    child unpickling truncated data (`UnpicklingError: pickle data was truncated`, a traceback).

    Here the data is written in full, before the child exists, into an anonymous file the child inherits and
    reads: starting a worker never waits on it, whatever it does, and a worker never reads part of its data.
    The child's first act, before reading anything, is to bind itself to this process's life
    (`_WORKER_PROGRAM`): a parent that dies at any time takes its workers with it, silently. A worker that dies
    at any point is then noticed by `_collect`, as in every later phase.
    """

    _fds: list[int]  # passed to the child: set by multiprocessing's Popen, extended by duplicate_for_child

    def _launch(self, process_obj: BaseProcess) -> None:
        tracker = resource_tracker.getfd()
        if tracker is None:
            raise RuntimeError("multiprocessing's resource tracker did not start")
        self._fds.append(tracker)
        data = _anonymous_file()
        done_here = [data]  # the child's copies: closed here once it holds them
        kept: list[int] = []  # this process's ends: closed with this object
        try:
            with open(data, "wb", closefd=False) as f:
                set_spawning_popen(self)  # pickled connections hand their fds to the child (duplicate_for_child)
                try:
                    reduction.dump(mp_spawn.get_preparation_data(process_obj.name), f)
                    reduction.dump(process_obj, f)
                finally:
                    set_spawning_popen(None)
            os.lseek(data, 0, os.SEEK_SET)
            exited, child_end = os.pipe()  # EOF here: the child is gone (its sentinel)
            kept.append(exited)
            done_here.append(child_end)
            program = _WORKER_PROGRAM.format(pdeathsig=PR_SET_PDEATHSIG, sigkill=int(signal.SIGKILL),
                                             parent=os.getpid(), tracker=tracker, data=data)
            flags: list[str] = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
            exe = mp_spawn.get_executable()
            self._fds += [data, child_end]
            self.pid = mp_util.spawnv_passfds(os.fsencode(exe), [exe, *flags, "-c", program,
                                                                 "--multiprocessing-fork"], self._fds)
            self.sentinel = exited
        finally:
            self.finalizer = mp_util.Finalize(self, _close, tuple(kept))
            for fd in done_here:
                os.close(fd)


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _anonymous_file() -> int:
    """A read-write file with no name (memfd where there is one), closed on exec unless passed on."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("glmconv-worker-start")
    fd, name = tempfile.mkstemp(prefix="glmconv-worker-start-")
    os.unlink(name)
    return fd


class _WorkerProcess(SpawnProcess):
    """A spawned worker started by `_WorkerPopen`."""

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> popen_spawn_posix.Popen:
        return _WorkerPopen(process_obj)


def _kill(procs: list[SpawnProcess]) -> None:
    """SIGKILL every started worker and wait for it: nothing of theirs writes after this returns."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join()


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class _Link:
    """The parent's two pipes to one worker: its outcome comes back on one, closing the other releases it.

    Plain pipes, not multiprocessing's Queue and Event: those hold named semaphores registered with
    multiprocessing's resource tracker, and a tracker killed mid-run is relaunched empty, then told to
    unregister semaphores it never saw (a KeyError traceback on the user's terminal). A pipe registers nothing.
    """

    def __init__(self, ctx: SpawnContext) -> None:
        self.out_recv, self.out_send = ctx.Pipe(duplex=False)
        self.done_recv, self.done_send = ctx.Pipe(duplex=False)

    def started(self) -> None:
        """The worker holds its own ends now: the parent's copies closed, so a dead worker reads as EOF."""
        self.out_send.close()
        self.done_recv.close()

    def release(self) -> None:
        self.done_send.close()

    def close(self) -> None:
        for conn in (self.out_recv, self.out_send, self.done_recv, self.done_send):
            conn.close()


def _collect(links: list[_Link], procs: list[SpawnProcess]) -> tuple[list[object], list[str]]:
    """One outcome per worker, and the workers that died (killed, or exited non-zero) before all were in.

    A dead worker is noticed at once, whatever phase it died in (importing torch, joining the group, inside a
    collective): its peers would wait for it forever, so they are killed too. Closing the release pipes lets
    the workers go once every outcome is in: no rank leaves while a peer may still be in a collective.
    """

    outcomes: list[object] = []
    died: list[str] = []
    waiting = {link.out_recv: link for link in links}
    try:
        while waiting and not died:
            ready = wait(list(waiting), timeout=DEATH_POLL_S)
            for conn in [c for c in list(waiting) if c in ready]:
                del waiting[conn]
                try:
                    outcomes.append(conn.recv())
                except (EOFError, OSError):
                    pass  # ended without an outcome: its exit code says how
            died = [f"rank {r} {_how(p.exitcode)}" for r, p in enumerate(procs) if p.exitcode]
            if waiting and not any(p.is_alive() for p in procs) and not wait(list(waiting), timeout=0):
                break
    finally:
        for link in links:
            link.release()
    if died:
        _kill(procs)
    for p in procs:
        p.join()
    return outcomes, died


def _worker(fn: RankFn[S], args: tuple[object, ...], rank: int, world: int, store: Path, results: Connection,
            parent: int, hold: tuple[Path, str] | None, done: Connection) -> None:
    """One rank of --workers: bound to its parent's life, holding the run's staging directory, never publishing.

    It ends with `os._exit`, never tearing gloo down: a gloo group destroyed, or its threads met by the
    interpreter's exit, while a peer is still talking aborts the process now and then ("terminate called without
    an active exception"). A rank that succeeded waits for `done` (every outcome is in, so no collective is in
    flight); a failed one leaves at once, so that its peers' collectives fail instead of waiting for it.
    """

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides, and kills
    _bind_to_parent(parent)
    try:
        if hold is not None:
            _HELD.append(output.join_stage(*hold))  # kept open (flocked) until this process ends
    except GlmconvError as exc:
        _send(results, str(exc))
        return
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cores_per_rank(world))  # the cores shared out: no rank oversubscribes them
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    age = phases.process_age()
    phases.add("worker_start", age or 0.0)  # a Python, torch's import and the group: what each worker costs first
    ok = False
    try:
        _send(results, _then_barrier(fn(*args, rank, world, dist.group.WORLD)))
        ok = True
    except GlmconvError as exc:
        _send(results, str(exc))
    except Exception as exc:
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _send(results, f"rank {rank}: {type(exc).__name__}: {line}")
    finally:
        _leave(results, done if ok else None)


def _send(results: Connection, outcome: object) -> None:
    try:
        results.send(outcome)
    except OSError:
        pass  # the parent is gone or gave up on this run: nothing to tell


def _leave(results: Connection, done: Connection | None) -> None:
    """Close the outcome pipe (sent in full), wait for the parent to release this rank when `done` is given,
    and end without any teardown."""

    results.close()
    if done is not None:
        try:
            done.recv()  # the parent closes its end once every outcome is in
        except (EOFError, OSError):
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _bind_to_parent(parent: int) -> None:
    """Die with the parent: PR_SET_PDEATHSIG (Linux) and, everywhere, a thread watching the parent's pid.

    The check after prctl covers a parent that died before the call (the signal would then never come).
    """

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher below is the only guard
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="glmconv-parent-watch", daemon=True).start()
