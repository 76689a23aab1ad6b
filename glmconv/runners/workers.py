"""`--workers auto`: how many worker processes a conversion gets on this machine.

Rule: one worker per 2 GB of input (a worker pays a process start and torch's import, ~1-6 s, that a smaller
share does not earn back), at most one per 4 cores when FP8 codes are more than half of the input (each worker
dequantises on its share of the cores: 4 slab threads at least) or one per 2 cores otherwise (a worker is a
writer thread and two readers), and at most 8 (one disk: more writers than that only queue on it).
"""

from __future__ import annotations

from glmconv.defaults import AUTO
from glmconv.numerics import dequant

BYTES_PER_WORKER = 2 * 10**9
MAX_AUTO_WORKERS = 8


def auto_workers(bytes_in: int, fp8_bytes: int, cores: int) -> int:
    """The worker count of `--workers auto` for `bytes_in` bytes of input, `fp8_bytes` of them FP8 codes."""
    per_core = 4 if 2 * fp8_bytes > bytes_in else 2
    by_bytes = -(-bytes_in // BYTES_PER_WORKER)
    return max(1, min(by_bytes, cores // per_core, MAX_AUTO_WORKERS))


def worker_count(workers: int | str, bytes_in: int, fp8_bytes: int) -> int:
    """`workers` itself, or the auto rule's count on this machine's cores."""
    if workers != AUTO:
        return int(workers)

    return auto_workers(bytes_in, fp8_bytes, dequant.cpu_count())
