"""Where export's per-tensor seconds go (its `plan` and `verify` phases), in parts, on one bench.

Usage: python benchmarks/plan_costs.py MCORE_DIR LIKE_DIR [--library]
Prints one JSON object: each part's best of 3 (s), each as a run's first (nothing cached); `sequence`: prepare, the
plan's checks and the audit once each in the CLI's order, the plans and passed pickles of one reused by the next.
LIKE_DIR stands for the export's output (an `export --fp8 --like` of an unchanged conversion is byte-identical to
it), so the audit runs on what export would have written. By default the collector is set as the CLI sets it
(glmconv.collector); --library: as a library caller's process keeps it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def best(fn: Callable[[], Any], clear: Callable[[], None], n: int = 3) -> float:
    times = []
    for _ in range(n):
        clear()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(min(times), 4)


def sequence(E: Any, src: Path, like: Path) -> dict[str, float]:
    """One export's per-tensor parts once each, in the CLI's order (what one part leaves, the next reuses)."""
    out = {}
    start = time.perf_counter()
    job = E.prepare(src, "/nonexistent/out", like=like, fp8=True)
    out["prepare"] = time.perf_counter() - start
    start = time.perf_counter()
    E.check_loadable(job.src, job.source)
    E.ExportRun(job, E.ExportOptions())
    out["export_plan"] = time.perf_counter() - start
    start = time.perf_counter()
    E.verify_staged(job, like)
    out["verify"] = time.perf_counter() - start
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    src, like = Path(sys.argv[1]), Path(sys.argv[2])
    library = "--library" in sys.argv[3:]
    from glmconv import collector

    if not library:
        collector.cli_process()
    from glmconv import phases, plan
    from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint
    from glmconv.io.torch_dist import pickle_bounds
    from glmconv.io.torch_dist.metadata import inspect_torch_dist
    from glmconv.plan import build_plan, detect_layout
    from glmconv.runners import export as E

    def clear() -> None:  # each part as a run's first: no pickle passed, no plan built yet
        pickle_bounds._PASSED.clear()
        if hasattr(plan, "_BuiltPlans"):  # (a tree before plans were kept)
            plan._BUILT = plan._BuiltPlans()

    out: dict[str, Any] = {"collector": "library" if library else "cli"}
    out["prepare_before_torch"] = best(lambda: E.prepare(src, "/nonexistent/out", like=like, fp8=True), clear, 1)
    phases.import_torch()
    clear()
    out["sequence"] = sequence(E, src, like)
    pkl = (src / "release" / ".metadata").read_bytes()
    out["metadata_bytes"] = len(pkl)
    out["bounds_scan"] = best(lambda: pickle_bounds._scan_bounds(pkl, pickle_bounds.MAX_TUPLE_NESTING), clear)
    out["inspect_torch_dist"] = best(lambda: inspect_torch_dist(src), clear)
    like_ck = inspect_hf_checkpoint(like)
    out["hf_tensors"] = len(like_ck.tensors)
    out["inspect_like"] = best(lambda: inspect_hf_checkpoint(like), clear)
    source = inspect_torch_dist(src)
    job = E.prepare(src, "/nonexistent/out", like=like, fp8=True)
    config = job.plan.config
    out["detect_layout"] = best(lambda: detect_layout(config, set(source.tensors)), clear)
    out["build_plan"] = best(lambda: build_plan(config, fp8=True, layout=job.plan.layout), clear)
    out["prepare"] = best(lambda: E.prepare(src, "/nonexistent/out", like=like, fp8=True), clear)
    out["export_plan"] = best(lambda: (E.check_loadable(job.src, job.source), E.ExportRun(job, E.ExportOptions())),
                              clear)
    out["verify"] = best(lambda: E.verify_staged(job, like), clear)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
