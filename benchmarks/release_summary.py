"""The figures of `benchmarks/gpu_release.sh` as tables: marginal seconds per GB between the 2 GB and 6 GB benches,
verify against convert, N workers against one, and the real-cut4 runs.

Usage: python benchmarks/release_summary.py RESULTS_DIR (holding times.txt and sizes.txt)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINE = re.compile(r"^(\S+) wall ([\d.]+) s, peak RSS (\d+) KB$")


def read_times(res: Path) -> dict[str, list[float]]:
    """Every run's wall seconds by name (a name run twice has both)."""
    times: dict[str, list[float]] = {}
    for line in (res / "times.txt").read_text().splitlines():
        m = LINE.match(line)
        if m:
            times.setdefault(m[1], []).append(float(m[2]))
    return times


def read_sizes(res: Path) -> dict[str, int]:
    """Bytes of each directory `du -sb` listed, by its name."""
    out: dict[str, int] = {}
    path = res / "sizes.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        n, where = line.split(maxsplit=1)
        out[Path(where).name] = int(n)
    return out


def best(times: dict[str, list[float]], name: str) -> float | None:
    return min(times[name]) if name in times else None


def bench_sizes(sizes: dict[str, int], kind: str) -> tuple[str, str]:
    """The smaller and the larger bench of `kind` (fp8 or bf16), as named: `fp8-2`, `fp8-6`."""
    made = sorted((n for n in sizes if n.startswith(f"{kind}-") and n.count("-") == 1), key=lambda n: sizes[n])
    return (made[0], made[-1]) if len(made) >= 2 else (f"{kind}-2", f"{kind}-6")


def marginal(times: dict[str, list[float]], sizes: dict[str, int], kind: str, step: str) -> float | None:
    """Seconds per GB of source between the smaller and the larger bench of `kind`."""
    lo, hi = bench_sizes(sizes, kind)
    small, large = best(times, f"{lo}-{step}"), best(times, f"{hi}-{step}")
    if small is None or large is None or lo not in sizes or hi not in sizes:
        return None
    return (large - small) / ((sizes[hi] - sizes[lo]) / 1e9)


def fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.3f}{unit}"


def bench_table(times: dict[str, list[float]], sizes: dict[str, int]) -> list[str]:
    steps = ["convert-w1", "convert-w2", "convert-w4", "convert-cpu-w1", "convert-cpu-w4", "verify-t2", "verify-t4",
             "verify-t8", "verify-w2", "export-w1", "export-w2", "export-w4", "cp-in", "cp-out", "cp-ex"]
    rows = ["| step | source | smaller s | larger s | marginal s/GB of source | vs convert-w1 (throughput) |",
            "|---|---|---|---|---|---|"]
    for kind in ("fp8", "bf16"):
        lo, hi = bench_sizes(sizes, kind)
        ref = marginal(times, sizes, kind, "convert-w1")
        for step in steps:
            m = marginal(times, sizes, kind, step)
            if m is None:
                continue
            ratio = None if ref is None or m <= 0 else ref / m
            rows.append(f"| {step} | {lo} / {hi} | {fmt(best(times, f'{lo}-{step}'))} | "
                        f"{fmt(best(times, f'{hi}-{step}'))} | {fmt(m)} | {fmt(ratio, 'x')} |")
    return rows


def rc4_table(times: dict[str, list[float]]) -> list[str]:
    rows = ["| real-cut4 step | wall s (each run) | vs the one-worker run |", "|---|---|---|"]
    for name in sorted(n for n in times if n.startswith("rc4-")):
        base = {"convert": "rc4-convert-w1", "export": "rc4-export-w1"}.get(name.split("-")[1])
        ratio = times[name][0] / best(times, base) if base in times and base != name else None
        rows.append(f"| {name} | {', '.join(f'{t:.2f}' for t in times[name])} | {fmt(ratio, 'x')} |")
    return rows


def main() -> None:
    res = Path(sys.argv[1])
    times, sizes = read_times(res), read_sizes(res)
    print("\n".join(bench_table(times, sizes) + [""] + rc4_table(times)))
    others = sorted(n for n in times if not n.startswith(("fp8-", "bf16-", "rc4-")))
    print("\n".join(["", "| other | wall s |", "|---|---|"] + [f"| {n} | {', '.join(map(str, times[n]))} |"
                                                            for n in others]))


if __name__ == "__main__":
    main()
