"""`--workers auto`: how many worker processes a run gets on this machine: one; and `--workers N` capped where more
cannot help.

On one machine a single worker already keeps the disk busy in every direction: FP8 is dequantised on the GPU
(above 8 G values/s) or in slabs on all of the machine's cores, BF16 bytes move by copy_file_range, export encodes
FP8 on the GPU or in slabs on the cores, verify compares on its threads. Measured on the H200 machine (16 cores,
one NVMe disk; issue 27, benchmarks/RESULTS.md): 2, 4 and 8 workers had one worker's marginal throughput and
each run paid the extra processes' start (a Python, torch's import, a CUDA context), 1.6x slower on a 6 GB FP8
convert. `--workers N` stays for a machine where that does not hold; torchrun ranks replace workers.

A count that cannot help is capped, and the summary (and stderr) says why: a run reading less than
WORKER_MIN_BYTES (100 GB) gets one worker -- each other worker's start, a Python, torch's import and a CUDA
context (4-5 s on the H100/H200 machines), is more than 5% of a disk-bound run of that size at the 1.2-1.7 GB/s
measured (issue 38), and the disk gives no more bytes to several readers; a count beyond the run's independent
pieces of work (an export's groups of files, a convert's mappings) or beyond this process's cores only adds
processes that wait or contend.
"""

from __future__ import annotations

from glmconv.defaults import AUTO, worker_min_bytes
from glmconv.numerics.dequant import cpu_count
from glmconv.text import count

AUTO_WORKERS = 1


def worker_count(workers: int | str) -> int:
    """`workers` itself, or the auto rule's count."""
    return AUTO_WORKERS if workers == AUTO else int(workers)


def capped(requested: int, nbytes: int, pieces: int, piece: str, plural: str, cores: int | None = None,
           min_bytes: int | None = None) -> tuple[int, str | None]:
    """`requested` workers for a run reading `nbytes`: one below `min_bytes` (`worker_min_bytes()`), else at most
    one per independent piece of work (`pieces` of `piece`, `plural`) and one per core; the reason in one line
    when that is fewer."""
    cores = cpu_count() if cores is None else cores
    min_bytes = worker_min_bytes() if min_bytes is None else min_bytes
    small = nbytes < min_bytes
    n = 1 if small else max(1, min(requested, pieces, cores))
    if n >= requested:
        return requested, None
    if small:
        why = (f"the run reads {nbytes / 1e9:.3g} GB, less than {min_bytes / 1e9:g} GB: one worker keeps the disk "
               "busy, and another's start (a Python, torch, a CUDA context) would cost more than it saves")
    elif pieces <= cores:
        why = f"the run has {count(pieces, piece, plural)} that a worker can take on its own"
    else:
        why = f"this process may run on {count(cores, 'core')} (more processes only contend for them)"
    return n, f"--workers {requested} capped to {n}: {why}"
