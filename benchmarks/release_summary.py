"""The figures of `benchmarks/gpu_release.sh` as tables: marginal seconds per GB between the 2 GB and 6 GB benches,
verify against convert, N workers against one, the real-cut4 runs, and the full release's estimate from them.

Usage: python benchmarks/release_summary.py RESULTS_DIR (holding times.txt and sizes.txt)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from glmconv.config import parse_config
from glmconv.fixtures.real import release_config
from glmconv.plan import build_plan

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
        ratio = times[name][0] / min(times[base]) if base in times and base != name else None
        rows.append(f"| {name} | {', '.join(f'{t:.2f}' for t in times[name])} | {fmt(ratio, 'x')} |")
    return rows


def release_bytes() -> tuple[int, int]:
    """The release's FP8 safetensors bytes and its BF16 torch_dist bytes (MTP and vision included), from the plan."""
    plan = build_plan(parse_config(release_config()), fp8=True)
    return sum(t.nbytes for t in plan.hf_index.values()), sum(t.nbytes for t in plan.mcore_index.values())


def write_rate(times: dict[str, list[float]], sizes: dict[str, int]) -> tuple[float, str] | None:
    """The disk's write rate (bytes/s) and how it was taken: `dd conv=fsync` of 16 GiB (the rc4 step), else cp+sync
    of real-cut4's conversion (the issue38 step: its reads come from the page cache); None without either."""
    if "disk-write-16g" in times:
        return 16 * 2**30 / min(times["disk-write-16g"]), "`dd conv=fsync`, 16 GiB"
    if "rc4-cp-out" in times and "rc4-mc" in sizes:
        gb = sizes["rc4-mc"] / 1e9
        return sizes["rc4-mc"] / min(times["rc4-cp-out"]), f"cp+sync of real-cut4's {gb:.1f} GB conversion"
    return None


def estimate_table(times: dict[str, list[float]], sizes: dict[str, int]) -> list[str]:
    """Each command on the full release: its disk part (cold reads, writes past the page cache) against real-cut4's
    warm run scaled by bytes; the larger of the two is the estimate (reads and writes share one disk: no overlap)."""
    rate = write_rate(times, sizes)
    if any(n not in times for n in ("rc4-cold-read", "rc4-mc-cold-read")) or "rc4" not in sizes \
            or "rc4-mc" not in sizes or rate is None:
        return ["(no release estimate: real-cut4's cold reads, its sizes or a disk write are missing)"]
    hf, mc = release_bytes()
    cut_hf, cut_mc = sizes["rc4"], sizes["rc4-mc"]
    read_hf, read_mc = cut_hf / min(times["rc4-cold-read"]), cut_mc / min(times["rc4-mc-cold-read"])
    write, how = rate
    read_both = hf / read_hf + mc / read_mc  # verify and parity read each checkpoint once
    rows = [f"Disk: cold read {read_hf / 1e9:.2f} GB/s (FP8 safetensors), {read_mc / 1e9:.2f} GB/s (`.distcp`); "
            f"write {write / 1e9:.2f} GB/s ({how}). Release: {hf:,} bytes FP8, {mc:,} bytes BF16.",
            "", "| command | reads | writes | disk part (s) | real-cut4 run scaled (s) | estimate (min) |",
            "|---|---|---|---|---|---|"]
    cases = [("convert", ["rc4-convert-w1"], hf / read_hf + mc / write, mc / cut_mc, "FP8", "BF16"),
             ("export --fp8 --like", ["rc4-export-w1", "rc4-export-cuda-w1"],
              mc / read_mc + hf / read_hf + hf / write, hf / cut_hf, "BF16 + --like's FP8", "FP8"),
             ("verify", ["rc4-verify-t2", "rc4-verify-w1"], read_both, (hf + mc) / (cut_hf + cut_mc), "both", "-")]
    for name, runs, disk, scale, reads, writes in cases:
        warm = next((t for t in (best(times, r) for r in runs) if t is not None), None)  # the rc4 step's name, else
        # the issue38 step's
        scaled = None if warm is None else warm * scale
        rows.append(f"| {name} | {reads} | {writes} | {disk:.0f} | {fmt(scaled)} | "
                    f"{max(disk, scaled or 0) / 60:.1f} |")
    rows.append(f"| parity (reading only) | both | - | {read_both:.0f} | see the parity report | "
                f"{read_both / 60:.1f} + compute |")
    return rows


def main() -> None:
    res = Path(sys.argv[1])
    times, sizes = read_times(res), read_sizes(res)
    print("\n".join(bench_table(times, sizes) + [""] + rc4_table(times) + [""] + estimate_table(times, sizes)))
    others = sorted(n for n in times if not n.startswith(("fp8-", "bf16-", "rc4-")))
    print("\n".join(["", "| other | wall s |", "|---|---|"] + [f"| {n} | {', '.join(map(str, times[n]))} |"
                                                            for n in others]))


if __name__ == "__main__":
    main()
