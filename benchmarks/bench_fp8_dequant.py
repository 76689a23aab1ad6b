"""FP8 block dequantisation speed: the reference call against convert's CPU slabs and the GPU (issue 14).

    python benchmarks/bench_fp8_dequant.py [--rows 2048,154880] [--cols 4096] [--threads 1,2,16] [--reps 3] [--json]

For each [rows, cols] weight (random codes, realistic scales) it times, best of `--reps`:
`reference tN` (dequantize_fp8_blocks with torch's intra-op threads = N), `slabs tN` (glmconv.numerics.dequant's
CpuDequantizer with N threads, intra-op 1, as convert runs it) and, when CUDA is visible, `cuda` (codes pinned,
to the GPU, dequantised, back to pinned memory: what convert's --device cuda pays per weight). Every result is
checked bit for bit against the reference. Reports values per second (G values/s).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from glmconv.numerics.dequant import CpuDequantizer, CudaDequantizer, torch_threads
from glmconv.numerics.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks


def best(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, torch.Tensor]:
    out, least = None, float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        least = min(least, time.perf_counter() - start)
    assert out is not None
    return least, out


def weight(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return quantize_fp8_blocks(torch.randn(rows, cols) * 0.02)


def measure(rows: int, cols: int, threads: list[int], reps: int) -> list[dict]:
    codes, scales = weight(rows, cols)
    n = codes.numel()
    with torch_threads(1):
        want = dequantize_fp8_blocks(codes, scales)
    rows_out = []

    def record(how: str, fn: Callable[[], torch.Tensor]) -> None:
        seconds, got = best(fn, reps)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{how}: not the reference's bits"
        rows_out.append({"shape": [rows, cols], "how": how, "seconds": seconds, "gvalues_per_s": n / seconds / 1e9})
        print(f"[{rows}, {cols}] {how:>14}: {n / seconds / 1e9:7.3f} G values/s ({seconds * 1e3:9.1f} ms)", flush=True)

    for t in threads:
        with torch_threads(t):
            record(f"reference t{t}", lambda: dequantize_fp8_blocks(codes, scales))
    for t in threads:
        dequantize = CpuDequantizer(t)
        with torch_threads(1):
            record(f"slabs t{t}", lambda d=dequantize: d(codes, scales, torch.bfloat16))
        dequantize.close()
    if torch.cuda.is_available():
        pinned, gpu = codes.pin_memory(), CudaDequantizer()
        gpu(pinned, scales, torch.bfloat16)  # CUDA context and kernels, untimed
        record("cuda", lambda: gpu(pinned, scales, torch.bfloat16))
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2048,154880")
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    threads = sorted({int(t) for t in a.threads.split(",")})
    print(f"host: {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    results = [r for rows in a.rows.split(",") for r in measure(int(rows), a.cols, threads, a.reps)]
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if a.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
