"""What pinned host memory costs on this GPU machine: a FP8 convert's readers read codes into pinned buffers and its
dequantizer copies each BF16 weight back through a pinned buffer, so a run that allocates more pinned memory than
torch's caching host allocator has freed pays the page pinning. Measured 2026-12-07 on an H100 at `a001616`
(benchmarks/RESULTS.md): not that convert's `read` wait (181 allocations, 0.13-0.19 s of thread time, against 0.87 s
of waiting); `37118a7`'s pinned outputs, held in the writer's queue, doubled the wait until `6f36685`.

Usage: python benchmarks/pin_probe.py [GB]                 the allocator alone (default 1 GB)
       python benchmarks/pin_probe.py convert SRC OUT ...  glmconv's convert (--device cuda, --force), then its
                                                           pinned allocations: how many, their bytes, their time
Prints JSON lines: GB/s of fresh pinned allocations (the caching allocator empty), of the same sizes again once
freed (its cache), of a plain allocation touched, and of a device-to-host copy into pinned and into pageable memory;
or the convert's phases and `torch.cuda.memory.host_memory_stats()`'s counts. PYTORCH_CUDA_ALLOC_CONF applies.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

PIECE = 64 << 20


def rate(label: str, nbytes: int, fn: Callable[[], Any]) -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"probe": label, "GB": round(nbytes / 1e9, 3), "s": round(seconds, 4),
                      "GB_per_s": round(nbytes / seconds / 1e9, 2)}), flush=True)


def allocator(gb: float) -> None:
    total = int(gb * 1e9) // PIECE * PIECE
    n = total // PIECE
    torch.empty(1, device="cuda")  # the context first: not in any figure
    kept: list[torch.Tensor] = []
    rate("pinned fresh", total, lambda: kept.extend(torch.empty(PIECE, dtype=torch.uint8, pin_memory=True)
                                                      for _ in range(n)))
    kept.clear()
    rate("pinned cached", total, lambda: kept.extend(torch.empty(PIECE, dtype=torch.uint8, pin_memory=True)
                                                       for _ in range(n)))
    rate("pageable touched", total, lambda: [torch.ones(PIECE, dtype=torch.uint8) for _ in range(n)])
    src = torch.empty(PIECE, dtype=torch.uint8, device="cuda")
    plain = torch.empty(PIECE, dtype=torch.uint8)
    rate("d2h pinned", total, lambda: [k.copy_(src) for k in kept])
    rate("d2h pageable", total, lambda: [plain.copy_(src) for _ in range(n)])


def convert(src: str, out: str, *extra: str) -> None:
    import glmconv

    threads = int(extra[extra.index("--read-threads") + 1]) if "--read-threads" in extra else 2
    summary = glmconv.convert(src, out, device="cuda", force=True, read_threads=threads)
    stats = getattr(torch.cuda.memory, "host_memory_stats", dict)()  # torch 2.7 and later
    keep = ("num_host_alloc", "host_alloc_time.total", "host_alloc_time.max", "allocated_bytes.peak",
            "active_bytes.peak", "allocations.allocated")
    print(json.dumps({"phases": summary["phases"], "read_threads": threads,
                      "host_memory_stats": {k: stats.get(k) for k in keep}}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["convert"]:
        convert(*sys.argv[2:])
    else:
        allocator(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
