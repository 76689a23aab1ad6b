"""What every job (convert, export, relayout) decides first, in one place: its source, its output, its plan, the HF
sidecar files it carries; each job's own record adds what is particular to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from glmconv.plan import Plan


@dataclass
class Job:
    """A source and an output (`source_job`s leave the source there: only `prepare` names an output), and the HF
    sidecar files (tokenizer, generation config) the job carries across."""

    src: Path
    out: Path
    sidecars: dict[str, Path] = field(default_factory=dict, kw_only=True)


@dataclass
class PlanJob(Job):
    """A job that runs one plan: every tensor on both sides, decided before a byte of tensor data is read."""

    plan: Plan
