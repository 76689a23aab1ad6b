"""The steps convert, export and relayout share: every rank runs its share of the plan into the staging
directory, rank 0 checks what all ranks did and finishes the output, and every rank sees one verdict (so none
hangs in a collective). A direction says only what is particular to it, as a `PlanRun`; `publish_run` runs it as
1, N or torchrun ranks (`glmconv.runners.ranks`) and publishes rank 0's summary.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from glmconv import phases
from glmconv.defaults import DEFAULT_CHUNK_BYTES
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io.jsonfile import JsonObject
from glmconv.plan import Mapping
from glmconv.progress import COPY, FLUSH, PUBLISH, VERIFY, Progress, say, workers_bar
from glmconv.runners.ranks import (
    Group,
    broadcast,
    gather,
    progress,
    progress_here,
    rank_label,
    run_on_output,
    try_,
    try_none,
)

R = TypeVar("R")  # what one rank's share comes back as, gathered on rank 0 (each direction has its own)


@dataclass(frozen=True)
class FlowOptions:
    """What every run of the shared flow takes (convert's, export's and relayout's options add their own)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # the largest piece of a tensor held at once
    progress: bool = True
    space_check: bool = True  # refuse up front an output that cannot fit on OUT's filesystem


class PlanRun(ABC, Generic[R]):
    """One direction of the plan (convert or export); an instance travels to every worker process."""

    verb: str
    show_progress: bool = True

    @abstractmethod
    def share_of(self, rank: int, world: int) -> list[Mapping]:
        """This rank's mappings, in the order it runs them."""

    noun: str = "tensors"  # what the progress bar counts: the summary's name for the tensors written

    @abstractmethod
    def share_bytes(self, share: list[Mapping]) -> int:
        """The bytes `share` writes: what the progress bar counts, as each write returns."""

    @abstractmethod
    def share_items(self, share: list[Mapping]) -> int:
        """The tensors `share` writes (`noun`), as the summary counts them."""

    @abstractmethod
    def run_share(self, share: list[Mapping], rank: int, stage: Path, prog: Progress, group: Group) -> R:
        """Write `share` into `stage` (`group`: the ranks' process group, None alone); the result goes to rank 0."""

    @abstractmethod
    def check(self, results: list[R]) -> None:
        """Rank 0: every source tensor read once and every destination written once, across all ranks."""

    def after_check(self, rank: int, stage: Path, group: Group) -> None:
        """Every rank, once the shares are checked: collective steps of the output format (none by default)."""

    @abstractmethod
    def finish(self, stage: Path, results: list[R], world: int) -> JsonObject:
        """Rank 0: sidecars and verification of the staged output; the summary to publish."""


class WritesMegatron(PlanRun[R]):
    """A run whose shares write each mapping's Megatron tensors as the plan has them (convert, relayout)."""

    noun = "Megatron tensors"

    def share_bytes(self, share: list[Mapping]) -> int:
        return sum(m.mcore_bytes for m in share)

    def share_items(self, share: list[Mapping]) -> int:
        return sum(len(m.mcore) for m in share)


def run_plan(run: PlanRun[R], stage: Path, rank: int, world: int, group: Group) -> JsonObject:
    """One rank's part of `run` (the `fn` that `ranks.run_on_output` calls); rank 0's summary on every rank."""
    share = run.share_of(rank, world)
    with progress(rank_label(run.verb, rank, world), run.share_bytes(share), run.share_items(share),
                  run.show_progress and progress_here(rank), run.noun) as prog:
        prog.phase(COPY, f"{prog.total_bytes / 1e9:.3f} GB in {prog.total_items:,} {run.noun}")
        read, start = phases.peek("read"), time.monotonic()
        outcome = try_(lambda: run.run_share(share, rank, stage, prog, group))
        phases.add("write", time.monotonic() - start - (phases.peek("read") - read))  # the rest: writing
        prog.phase(FLUSH, prog.copy_done())
        gathered = gather(group, outcome, world)
        results = [r for r in gathered if not isinstance(r, str)]
        error = None
        if rank == 0:
            error = next((r for r in gathered if isinstance(r, str)), None) or try_none(lambda: run.check(results))
        _raise(broadcast(group, error))
        with phases.timed("flush"):
            run.after_check(rank, stage, group)
        prog.phase(VERIFY)
        with phases.timed("verify"):
            verdict = try_(lambda: run.finish(stage, results, world)) if rank == 0 else None
    if isinstance(verdict, dict):  # rank 0's own phases travel with its summary (from a worker process too)
        verdict = {**verdict, "phases": phases.take(), "busy": phases.take_busy()}
    return _summary(broadcast(group, verdict))


def publish_run(run: PlanRun[R], out: Path, inputs: dict[str, Path | None], force: bool, workers: int,
                space_check: Callable[[], object] | None) -> JsonObject:
    """`run` staged beside `out`, run on `workers` ranks, verified and published: how every command writes."""

    with workers_bar(workers, run.show_progress):  # a worker killed with its bar up: erased before the message
        summary = run_on_output(out, inputs, force, run_plan, (run,), workers, run.verb, space_check=space_check,
                                on_publish=lambda: say(run.verb, PUBLISH, str(out), enabled=run.show_progress))
    return {**summary, "phases": phases.merged(summary.get("phases"), phases.take()),
            "busy": phases.merged(summary.get("busy"), phases.take_busy())}


def shares(mappings: list[Mapping], n: int) -> list[list[Mapping]]:
    """Split the plan across `n` ranks, balanced by source bytes (largest first onto the lightest rank)."""
    return balanced([[m] for m in mappings], n)


def balanced(groups: list[list[Mapping]], n: int) -> list[list[Mapping]]:
    """Groups of mappings that go to one rank together, across `n` ranks: largest first (by source bytes) onto
    the lightest rank."""
    buckets: list[list[Mapping]] = [[] for _ in range(n)]
    loads = [0] * n
    for group in sorted(groups, key=lambda g: -sum(m.hf_bytes for m in g)):
        i = loads.index(min(loads))
        buckets[i].extend(group)
        loads[i] += sum(m.hf_bytes for m in group)
    return buckets


def check_once(names: Iterable[str], planned: Iterable[str], what: str) -> None:
    """Each of `planned` appears in `names` exactly once, and nothing else does; else the first culprit, named."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise CheckpointError(f"{name}: {what} twice")
        seen.add(name)
    want = set(planned)
    missing, extra = sorted(want - seen), sorted(seen - want)
    if missing:
        raise CheckpointError(f"{missing[0]}: never {what} ({len(missing)} planned tensors were not)")
    if extra:
        raise CheckpointError(f"{extra[0]}: {what} but not planned")


def _raise(error: str | None) -> None:
    if error:
        raise GlmconvError(error)


def _summary(verdict: JsonObject | str | None) -> JsonObject:
    """Rank 0's summary; its error (a message) raised on every rank."""
    if isinstance(verdict, dict):
        return verdict
    _raise(verdict)
    raise GlmconvError("rank 0 reported no summary")
