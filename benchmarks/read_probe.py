"""How fast this machine copies files from the page cache into memory, by thread count: the ceiling of export's
readers (each reads its step's bytes with preadv into a pinned buffer for the GPU, or a plain one).

Usage: python benchmarks/read_probe.py DIR [DIR...]   (the files should be in the page cache: read them once first)
Prints one JSON line per (buffer kind, threads): GB/s over every regular file under the DIRs, in 8 MiB reads.
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


def main() -> None:
    import torch

    work = files(sys.argv[1:])
    run(work, 4, False)  # into the page cache, once
    for pinned in ((False, True) if torch.cuda.is_available() else (False,)):
        for threads in (1, 2, 4, 8):
            gbs = max(run(work, threads, pinned) for _ in range(2))
            print(json.dumps({"pinned": pinned, "threads": threads, "GB": round(sum(s for _, s in work) / 1e9, 2),
                              "GB_per_s": round(gbs, 2)}), flush=True)


if __name__ == "__main__":
    main()
