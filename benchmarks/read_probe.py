"""How fast this machine copies files from the page cache into memory, by thread count: the ceiling of export's
readers (each reads its step's bytes with preadv into a pinned buffer for the GPU, or a plain one).

Usage: python benchmarks/read_probe.py DIR [DIR...]   (the files should be in the page cache: read them once first)
Prints one JSON line per (buffer kind, threads): GB/s over every regular file under the DIRs, in 8 MiB reads; then,
for a DIR that is a torch_dist checkpoint, `DcpReader.read` of each of its tensors (a new tensor each, pinned or not:
as export's GPU readers read; then, plain, into `ReadBuffers`, as its CPU readers read) against the same bytes read
into one reused buffer.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

CHUNK = 8 << 20


def files(dirs: list[str]) -> list[tuple[str, int]]:
    out = []
    for d in dirs:
        for p in sorted(Path(d).rglob("*")):
            if p.is_file() and not p.is_symlink():
                out.append((str(p), p.stat().st_size))
    return out


def run(work: list[tuple[str, int]], threads: int, pinned: bool) -> float:
    import torch

    jobs = [(path, off, min(CHUNK, size - off)) for path, size in work for off in range(0, size, CHUNK)]
    lock = threading.Lock()
    total = sum(n for _, _, n in jobs)

    def worker() -> None:
        buf = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=pinned)
        view = memoryview(buf.numpy()).cast("B")
        fds: dict[str, int] = {}
        while True:
            with lock:
                if not jobs:
                    break
                path, off, n = jobs.pop()
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            os.preadv(fd, [view[:n]], off)
        for fd in fds.values():
            os.close(fd)

    start = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return total / (time.perf_counter() - start) / 1e9


def reader_rates(src: str, pinned: bool) -> dict[str, float]:
    """GB/s of `DcpReader.read` (a new tensor a read; then, not pinned, into `ReadBuffers`) and of the same extents
    into one reused buffer."""
    import torch

    from glmconv.io.byte_copy import FileCopier
    from glmconv.io.read_buffers import ReadBuffers
    from glmconv.io.torch_dist.reader import DcpReader

    r = DcpReader(src, check_finite=False, pin=pinned)
    names = [n for n in r.names() if r.locatable(n)]
    total = sum(r._nbytes(n) for n in names)
    for n in names:  # every chunk located first (shared with the pooled reader below): the rates are the reads'
        r.read(n, check=False)
    start = time.perf_counter()
    for n in names:
        r.read(n, check=False)
    fresh = total / (time.perf_counter() - start) / 1e9
    pooled: float | None = None
    if not pinned:  # pinned reads stay on torch's caching host allocator (glmconv/io/read_buffers.py)
        pooled_reader = DcpReader(src, check_finite=False, sibling=r, buffers=ReadBuffers(512 << 20))
        start = time.perf_counter()
        for n in names:
            pooled_reader.read(n, check=False)
        pooled = total / (time.perf_counter() - start) / 1e9
    buf = torch.empty(max(r._nbytes(n) for n in names), dtype=torch.uint8, pin_memory=pinned)
    view = memoryview(buf.numpy()).cast("B")
    with FileCopier() as files:
        start = time.perf_counter()
        for n in names:
            size = r._nbytes(n)
            files.read_into(r.byte_extents(n, 0, size), view[:size])
        reused = total / (time.perf_counter() - start) / 1e9
    return {"GB": round(total / 1e9, 2), "read_GB_per_s": round(fresh, 2),
            "read_buffers_GB_per_s": None if pooled is None else round(pooled, 2),
            "reused_buffer_GB_per_s": round(reused, 2)}


def main() -> None:
    import torch

    for d in sys.argv[1:]:
        if (Path(d) / "release" / ".metadata").is_file():
            for pinned in ((False, True) if torch.cuda.is_available() else (False,)):
                for _ in range(2):
                    print(json.dumps({"reader": d, "pinned": pinned, **reader_rates(d, pinned)}), flush=True)
    work = files(sys.argv[1:])
    run(work, 4, False)  # into the page cache, once
    for pinned in ((False, True) if torch.cuda.is_available() else (False,)):
        for threads in (1, 2, 4, 8):
            gbs = max(run(work, threads, pinned) for _ in range(2))
            print(json.dumps({"pinned": pinned, "threads": threads, "GB": round(sum(s for _, s in work) / 1e9, 2),
                              "GB_per_s": round(gbs, 2)}), flush=True)


if __name__ == "__main__":
    main()
