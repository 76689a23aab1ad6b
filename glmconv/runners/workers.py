"""`--workers auto`: how many worker processes a run gets on this machine: one.

On one machine a single worker already keeps the disk busy in every direction: FP8 is dequantised on the GPU
(above 8 G values/s) or in slabs on all of the machine's cores, BF16 bytes move by copy_file_range, export encodes
FP8 on its threads ahead of the writer, verify compares on its threads. Measured on the H200 machine (16 cores,
one NVMe disk; issue 27, benchmarks/RESULTS.md): 2, 4 and 8 workers had one worker's marginal throughput and
each run paid the extra processes' start (a Python, torch's import, a CUDA context), 1.6x slower on a 6 GB FP8
convert. `--workers N` stays for a machine where that does not hold; torchrun ranks replace workers.
"""

from __future__ import annotations

from glmconv.defaults import AUTO

AUTO_WORKERS = 1


def worker_count(workers: int | str) -> int:
    """`workers` itself, or the auto rule's count."""
    return AUTO_WORKERS if workers == AUTO else int(workers)
