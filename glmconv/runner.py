"""What every plan runner (convert, export) shares: staging, atomic publish, and running as 1, N or torchrun ranks.

A runner's rank function has the signature `fn(*args, rank, world, group)`; `run_ranks` calls it in this
process, in `workers` spawned gloo processes, or once per torchrun rank, and returns rank 0's summary.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from glmconv.errors import GlmconvError

STAGING_SUFFIX = ".glmconv-staging"
RankFn = Callable[..., dict[str, Any]]


# ---- staging and publishing --------------------------------------------------------------------------

def staging_dir(out: Path) -> Path:
    return out.with_name(out.name + STAGING_SUFFIX)


def check_output(out: Path, force: bool) -> None:
    """Refuse an existing OUT_DIR unless --force; never half-clear it here (publish replaces it whole)."""
    if out.exists() and not out.is_dir():
        raise GlmconvError(f"{out}: exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise GlmconvError(f"{out}: already exists and is not empty; pass --force to replace it")
    parent = out.resolve().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise GlmconvError(f"{parent}: output parent directory {what}")
    if not os.access(parent, os.W_OK):
        raise GlmconvError(f"{parent}: not writable")


def fresh_staging(out: Path) -> Path:
    stage = staging_dir(out)
    if stage.exists():
        shutil.rmtree(stage)  # left by an interrupted run: never published, safe to drop
    stage.mkdir(parents=True)
    return stage


def publish(stage: Path, out: Path) -> None:
    """Swap the verified staging directory into place; an old OUT_DIR (with --force) goes only now."""
    trash = out.with_name(out.name + ".glmconv-old")
    if trash.exists():
        shutil.rmtree(trash)
    if out.exists():
        os.replace(out, trash)
    os.replace(stage, out)
    if trash.exists():
        shutil.rmtree(trash)


def cleanup(stage: Path, rank: int) -> None:
    if rank == 0 and stage.exists():
        shutil.rmtree(stage, ignore_errors=True)


# ---- errors that every rank must see -----------------------------------------------------------------

def try_(fn: Callable[[], Any]) -> Any:
    """Run `fn`; a user-facing error becomes its message (so every rank still reaches the collectives)."""
    try:
        return fn()
    except GlmconvError as exc:
        return str(exc)


def try_none(fn: Callable[[], Any]) -> str | None:
    out = try_(fn)
    return out if isinstance(out, str) else None


def try_raise(fn: Callable[[], Any], stage: Path, rank: int) -> None:
    try:
        fn()
    except GlmconvError:
        cleanup(stage, rank)
        raise


def gather(group: Any, value: Any, world: int) -> list[Any]:
    if group is None:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def broadcast(group: Any, value: Any) -> Any:
    """Rank 0's `value`, seen by every rank."""
    if group is None:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def collective_error(group: Any, error: str | None) -> str | None:
    """Rank 0's verdict, seen by every rank."""
    return broadcast(group, error)


def progress(label: str, total: int, items: int, enabled: bool) -> Any:
    from glmconv.progress import Progress

    return Progress(label, total, items, enabled=enabled)


# ---- running: one process, --workers N, or torchrun ranks ---------------------------------------------

def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun with more than one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ["RANK"]), world) if world > 1 and "RANK" in os.environ else None


def run_on_output(out: Path, force: bool, fn: RankFn, args: tuple[Any, ...], workers: int,
                  what: str) -> dict[str, Any]:
    """Check OUT_DIR, then `run_ranks` while holding OUT_DIR's exclusive lock (`glmconv.lock`).

    The launching process takes the lock (its `--workers` children run inside it); under torchrun rank 0
    does, and a refusal there ends the job (torchrun stops the other ranks).
    """
    from contextlib import nullcontext

    from glmconv.lock import OutputLock

    check_output(out, force)
    env = torchrun_env()
    with OutputLock(out) if env is None or env[0] == 0 else nullcontext():
        check_output(out, force)  # again, under the lock: another run may have published OUT since
        return run_ranks(fn, args, workers, what)


def run_ranks(fn: RankFn, args: tuple[Any, ...], workers: int, what: str) -> dict[str, Any]:
    """`fn(*args, rank, world, group)` under torchrun, in `workers` processes, or here; rank 0's summary."""
    env = torchrun_env()
    if env is not None:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            return fn(*args, env[0], env[1], dist.group.WORLD)
        finally:
            dist.destroy_process_group()
    if workers > 1:
        return spawn(fn, args, workers, what)
    return fn(*args, 0, 1, None)


def spawn(fn: RankFn, args: tuple[Any, ...], workers: int, what: str) -> dict[str, Any]:
    """--workers N on one machine: N gloo processes, each running its rank of `fn`."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="glmconv-pg-") as tmp:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(fn, args, r, workers, Path(tmp) / "store", results))
                 for r in range(workers)]
        for p in procs:
            p.start()
        outcomes = _collect(results, procs)
    dead = [f"rank {r} {_how(p.exitcode)}" for r, p in enumerate(procs) if p.exitcode]
    if dead:  # first: the survivors' errors are only the echo of a lost peer
        raise GlmconvError(f"a {what} worker died ({', '.join(dead)}); nothing published")
    errors = [o for o in outcomes if isinstance(o, str)]
    if errors:
        raise GlmconvError(errors[0])
    if not any(isinstance(o, dict) for o in outcomes):
        raise GlmconvError(f"no {what} worker reported a result; nothing published")
    return next(o for o in outcomes if isinstance(o, dict))


def _how(exitcode: int) -> str:
    import signal

    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _collect(results: Any, procs: list[Any]) -> list[Any]:
    """One outcome per worker; a worker that died without one is noticed instead of waited on."""
    import queue

    outcomes: list[Any] = []
    while len(outcomes) < len(procs):
        try:
            outcomes.append(results.get(timeout=1.0))
        except queue.Empty:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join()
    return outcomes


def _worker(fn: RankFn, args: tuple[Any, ...], rank: int, world: int, store: Path, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results.put(fn(*args, rank, world, dist.group.WORLD))
    except GlmconvError as exc:
        results.put(str(exc))
    except Exception as exc:  # noqa: BLE001 - e.g. gloo losing a killed peer: one line, the parent decides
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        results.put(f"rank {rank}: {type(exc).__name__}: {line}")
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group may already be broken by a lost peer
            pass
