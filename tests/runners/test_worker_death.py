"""Issue 25: a `--workers` rank that dies (the OOM killer's SIGKILL) is noticed at once, whatever it was doing:
starting (importing torch, joining the gloo group), before its peers' first collective, inside one, or after
its result. The launching process kills the survivors and says so; it never waits for the dead."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from glmconv.errors import GlmconvError
from glmconv.runners import ranks

PHASES = ["before-the-first-collective", "inside-a-collective", "after-its-result"]


def rank_dying_at(phase: str, rank: int, world: int, group: Any) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself at `phase`; rank 0 does what a runner does (collectives, then a result)."""
    import torch.distributed as dist

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1 and phase == "before-the-first-collective":
        die()
    ranks.gather(group, rank, world)
    if rank == 1 and phase == "inside-a-collective":
        die()
    dist.barrier(group=group)
    if rank == 1 and phase == "after-its-result":
        import threading

        threading.Timer(0.5, die).start()  # while it waits for every outcome to be in
    if rank == 0 and phase == "after-its-result":
        time.sleep(3)  # rank 1's result is in, rank 0's not yet
    return {"rank": rank}


@pytest.mark.parametrize("phase", PHASES)
def test_a_worker_killed_in_any_phase_ends_the_run_at_once(phase: str) -> None:
    start = time.monotonic()
    with pytest.raises(GlmconvError, match=r"^a test worker died \(rank 1 killed by SIGKILL\); nothing published$"):
        ranks.spawn(rank_dying_at, (phase,), 2, "test")
    assert time.monotonic() - start < 60


def test_a_worker_killed_right_after_it_starts_ends_the_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed from outside before it ran a line of glmconv (as the OOM killer would, while it imports torch)."""
    collect = ranks._collect

    def kill_rank_1_first(links: Any, procs: list[Any]) -> Any:
        procs[1].kill()
        return collect(links, procs)

    monkeypatch.setattr(ranks, "_collect", kill_rank_1_first)
    with pytest.raises(GlmconvError, match=r"^a test worker died \(rank 1 killed by SIGKILL\); nothing published$"):
        ranks.spawn(rank_dying_at, ("never",), 2, "test")
