"""The CLI process's garbage collector kept off the objects that live as long as the run.

A run's objects are mostly alive until it exits: the modules' (torch's, about 200,000 objects) and the plan's records
of every tensor. Each of Python's full collections traverses all of them, and a run that builds per-tensor records
triggers many: on the 3 GB FP8 bench (5,448 HF tensors) they were 40% of export's audit and 15-30% of its plan.
Frozen (`gc.freeze`), they are no longer traversed; they were never garbage. Only in the CLI's own process
(`cli_process`): a library caller's heap is its own.
"""

from __future__ import annotations

import gc

_CLI: list[bool] = []


def cli_process() -> None:
    """This process is the glmconv CLI's: what its imports made so far is settled, and so is each later `settle`."""
    _CLI.append(True)
    settle()


def settle() -> None:
    """The objects alive now (torch just imported, a plan just made) live until the process exits: out of the
    collector's sight in the CLI's process; nothing anywhere else."""
    if _CLI:
        gc.freeze()
