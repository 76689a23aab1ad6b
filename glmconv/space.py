"""What a run will take before it starts: the time it should need and whether its output fits on the disk.

Time is estimated from bytes and a stated throughput (`THROUGHPUT`), measured on this project's benchmark host
(benchmarks/RESULTS.md: 2 shared cores, a virtual disk): a planning figure, not a promise; faster disks and
more cores finish sooner. Space is the free space (`os.statvfs`, blocks available to an unprivileged user) of
the filesystem that will hold OUT: the nearest existing ancestor of OUT (the staging directory is made beside
OUT and renamed into place, so it is on the same filesystem). With `--force` the old OUT stays until the new
one is verified, so the new output needs its full size on top of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from glmconv.errors import GlmconvError

# Bytes of input per second. BF16 convert and export move bytes (0.34-0.66 and 0.41-1.07 GB/s measured);
# 0.3 GB/s is below the slowest of those. An FP8 source dequantises (10.4 s per GB measured): 0.1 GB/s.
THROUGHPUT = {"bf16": 0.3e9, "fp8": 0.1e9}
THROUGHPUT_BASIS = "below the slowest rate measured on the project's 2-core benchmark host, benchmarks/RESULTS.md"
SLACK_BYTES = 1 << 20  # headers, index, metadata, sidecars: well under 1 MiB at any size
SLACK_DIVISOR = 100  # and 1 % of the tensor bytes


def estimate_seconds(bytes_in: int, fp8: bool) -> float:
    """Seconds to process `bytes_in` at the stated throughput (THROUGHPUT)."""
    return bytes_in / THROUGHPUT["fp8" if fp8 else "bf16"]


def needed_bytes(bytes_out: int) -> int:
    """The tensor bytes plus room for headers, index, metadata and sidecar files."""
    return bytes_out + bytes_out // SLACK_DIVISOR + SLACK_BYTES


def nearest_existing(out: str | Path) -> Path:
    """OUT itself when it exists, else its nearest existing ancestor (absolute)."""
    p = Path(os.path.abspath(out))
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def free_bytes(path: Path) -> int | None:
    """Bytes available to an unprivileged writer on the filesystem holding `path`; None when the filesystem
    reports no size at all (f_blocks 0: sysfs, procfs, some FUSE and network mounts), so nothing is known."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        raise GlmconvError(f"{path}: cannot read the free space ({exc.strerror or exc})") from None
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def plan(out: str | Path, bytes_in: int, bytes_out: int, fp8: bool, check: bool = True) -> dict[str, Any]:
    """The estimate and the space at OUT's filesystem; with `check`, refuse (GlmconvError, exit 2) an output that
    cannot fit. A filesystem that reports no size is not checked (`fits` None)."""
    where = nearest_existing(out)
    free, need = free_bytes(where), needed_bytes(bytes_out)
    fits = None if free is None else need <= free
    if check and free is not None and not fits:
        raise GlmconvError(f"{out}: the output needs {need / 1e9:.3f} GB but {where} has {free / 1e9:.3f} GB free; "
                           f"free some space, choose another OUT, or pass --no-space-check to try anyway")
    return {"estimate_s": round(estimate_seconds(bytes_in, fp8), 1),
            "throughput_bytes_per_s": THROUGHPUT["fp8" if fp8 else "bf16"], "throughput_basis": THROUGHPUT_BASIS,
            "space_needed_bytes": need, "space_free_bytes": free, "space_checked_at": str(where),
            "fits": fits}
