"""What pinned host memory costs on this GPU machine: a FP8 convert's readers read codes into pinned buffers and its
dequantizer copies each BF16 weight back into a new pinned tensor, so a run that allocates more pinned memory than
torch's caching host allocator has freed pays the page pinning (the leading suspect for a convert's `read` wait).

Usage: python benchmarks/pin_probe.py [GB]   (default 1: about a 1 GB FP8 bench's codes)
Prints one JSON line per measurement: GB/s of fresh pinned allocations (the caching allocator empty), of the same
sizes again once freed (its cache), of a plain allocation touched, and of a device-to-host copy into pinned and into
pageable memory.
"""

from __future__ import annotations

import json
import sys
import time

import torch

PIECE = 64 << 20


def rate(label: str, nbytes: int, fn: object) -> None:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(json.dumps({"probe": label, "GB": round(nbytes / 1e9, 3), "s": round(seconds, 4),
                      "GB_per_s": round(nbytes / seconds / 1e9, 2)}), flush=True)


def main() -> None:
    total = int(float(sys.argv[1] if len(sys.argv) > 1 else 1) * 1e9) // PIECE * PIECE
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


if __name__ == "__main__":
    main()
