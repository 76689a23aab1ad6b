"""Time `glmconv convert` (and `export`, `audit-names`) against `cp -r` of the same bytes on the same disk.

For every size in BENCH_SIZES (default 1GB,4GB; BF16) and BENCH_FP8_SIZES (default 1GB; the release's FP8 set):

1. `glmconv fixture make SRC --preset bench --size S [--fp8]` (timed too);
2. BENCH_REPEAT rounds (default 3) of, in this order: `cp -r SRC DST`; `cp -r SRC DST && sync` (durable, as
   convert is: it fsyncs every data file); `glmconv convert SRC OUT` single-process; `--workers BENCH_WORKERS`
   (default 2); `cp -r SRC DST` again (so cp brackets the converts; SRC was just written, so it is cache-warm,
   and the `input cached` column says how much of it was in the page cache before each step, by mincore);
3. with BENCH_COLD=1 (default) two more steps per round on a cold input: SRC's pages are dropped with
   posix_fadvise(DONTNEED) after fsync (no root needed; residency is checked), then `cp -r`, and again for
   `convert`;
4. when the CLI has `export`: rounds of `cp -r OUT X` and `glmconv export OUT EXP` on the converted checkpoint;
5. when it has `relayout`: rounds of `glmconv relayout OUT REL --to mcore` (bytes only move: file to file), against
   the same `cp -r OUT X`;
6. when it has `verify`: rounds of `glmconv verify SRC OUT` (every value of both, compared), against the
   single-process convert of the same SRC (`vs convert`: convert's seconds over verify's, 1.0 = as fast).

Every command runs as a child process: wall time is perf_counter around it; peak memory is the largest sum of
RSS over the process tree, sampled every 50 ms with psutil (also RSS minus file-backed shared pages, since
safetensors reads through mmap and mapped page cache counts in RSS); CPU time is getrusage's children delta;
`others` is the average number of cores other processes kept busy during the step (/proc/stat busy time minus
ours), because a shared machine makes wall times noisy: tables report the fastest round (least disturbed)
and the median. Between steps outputs are removed and `sync` runs, untimed. With BENCH_QUIET_S > 0 (default
20) each step first waits up to that long for other processes to use less than BENCH_QUIET_CORES (0.5).

Results: BENCH_DIR/results.json (every run) and a Markdown table on stdout. Other knobs: BENCH_DIR (default
bench-data), BENCH_PROFILE=1 (a CPU-time cProfile of the first BF16 single-process convert), BENCH_KEEP=1
(keep the checkpoints).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
GLMCONV = [PY, "-m", "glmconv"]
REAL_CONFIG = ROOT / "fixtures" / "glm-5.3-flash.config.json"
POLL_S = 0.05
TICK = os.sysconf("SC_CLK_TCK")


def parse_size(text: str) -> int:
    from glmconv_cli.sizes import parse_size as parse

    return parse(text)


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


# ---- measuring one command ----------------------------------------------------------------------------

def _busy_seconds() -> float:
    """CPU seconds spent busy (all cores, all processes) since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v[:8]) - idle) / TICK


def _tree_memory(root: psutil.Process) -> tuple[int, int]:
    rss = anon = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            mi = p.memory_info()
        except psutil.Error:
            continue
        rss += mi.rss
        anon += mi.rss - getattr(mi, "shared", 0)
    return rss, anon


def wait_quiet(max_s: float, cores: float) -> float:
    """Wait (up to max_s) for a 1 s window in which other processes use fewer than `cores` cores."""
    t0 = time.perf_counter()
    while True:
        b0, w0 = _busy_seconds(), time.perf_counter()
        time.sleep(1.0)
        load = (_busy_seconds() - b0) / (time.perf_counter() - w0)
        if load < cores or time.perf_counter() - t0 >= max_s:
            return round(time.perf_counter() - t0, 1)


def run_timed(name: str, cmd: list[str], log_dir: Path, quiet: tuple[float, float] = (0, 0)) -> dict[str, Any]:
    """Run `cmd`: wall seconds, peak tree RSS (and RSS minus shared), CPU seconds, others' load, exit code."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    waited = wait_quiet(*quiet) if quiet[0] > 0 else 0.0
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = {"rss": 0, "anon": 0}
    with open(log, "wb") as out:
        busy0, t0 = _busy_seconds(), time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        done = threading.Event()

        def poll() -> None:
            try:
                root = psutil.Process(proc.pid)
            except psutil.Error:
                return
            while not done.is_set():
                rss, anon = _tree_memory(root)
                peak["rss"], peak["anon"] = max(peak["rss"], rss), max(peak["anon"], anon)
                done.wait(POLL_S)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        rc = proc.wait()
        seconds = time.perf_counter() - t0
        busy = _busy_seconds() - busy0
        done.set()
        poller.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = {"seconds": round(seconds, 3), "rc": rc, "cpu_seconds": round(cpu, 2),
              "others_cores": round(max(0.0, busy - cpu) / seconds, 2) if seconds > 0 else None,
              "waited_for_quiet_s": waited, "peak_rss_bytes": peak["rss"], "peak_rss_minus_shared_bytes": peak["anon"],
              "max_single_process_rss_bytes": after.ru_maxrss * 1024}
    if rc != 0:
        result["output_tail"] = log.read_text(errors="replace")[-2000:]
        print(f"!! {name} failed (exit {rc}):\n{result['output_tail']}", file=sys.stderr)
    return result


def _short(arg: str) -> str:
    return arg.replace(str(ROOT) + "/", "").replace(PY, "python")


def sync() -> None:
    subprocess.run(["sync"], check=False)


def rm(*paths: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    sync()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def resident_fraction(path: Path) -> float | None:
    """Share of the directory's bytes in the page cache (mincore, via util-linux fincore)."""
    files = [str(f) for f in path.rglob("*") if f.is_file() and f.stat().st_size]
    if not files or not shutil.which("fincore"):
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *files],
                         capture_output=True, text=True, check=False)
    res = size = 0
    for line in out.stdout.split("\n"):
        parts = line.split()
        if len(parts) == 2:
            res, size = res + int(parts[0]), size + int(parts[1])
    return min(1.0, round(res / size, 3)) if size else None


def evict(path: Path) -> None:
    """Drop the directory's clean pages from the page cache (posix_fadvise DONTNEED after fsync; no root)."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---- steps and cases -----------------------------------------------------------------------------------

class Case:
    """One fixture and the runs of every step on it."""

    def __init__(self, label: str, base: Path, opts: dict[str, Any]) -> None:
        self.label, self.base, self.opts = label, base, opts
        self.logs = base / "logs"
        self.row: dict[str, Any] = {"case": label, "steps": {}}

    def step(self, name: str, cmd: list[str], warm_of: Path | None, rnd: int) -> dict[str, Any]:
        warm = resident_fraction(warm_of) if warm_of is not None else None
        r = run_timed(f"{self.label}-{name}-{rnd}", cmd, self.logs, self.opts["quiet"])
        r["input_resident_before"] = warm
        s = self.row["steps"].setdefault(name, {"cmd": " ".join(_short(c) for c in cmd), "runs": []})
        s["runs"].append(r)
        print(f"  [{rnd}] {name:<15} {r['seconds']:8.2f} s  cpu {r['cpu_seconds']:6.2f} s  others {r['others_cores']}"
              f"  rc {r['rc']}  peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB  cached {warm}", flush=True)
        return r


def run_case(size: int, fp8: bool, base: Path, opts: dict[str, Any]) -> dict[str, Any]:
    kind = "fp8" if fp8 else "bf16"
    label = f"{size / 1e9:g}GB-{kind}"
    src, cp_dst, out1, out2, cold = (base / f"{x}-{label}" for x in ("hf", "cp", "mcore", "mcore-w", "mcore-cold"))
    rm(src, cp_dst, out1, out2, cold)
    c = Case(label, base, opts)
    c.row.update(requested_bytes=size, fp8=fp8)
    print(f"== {label}", flush=True)
    make = [*GLMCONV, "fixture", "make", str(src), "--preset", "bench", "--size", str(size), "--json"]
    if c.step("fixture", make + (["--fp8"] if fp8 else []), None, 0)["rc"]:
        return c.row
    sync()
    info = json.loads((c.logs / f"{label}-fixture-0.log").read_text().strip().splitlines()[-1])
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    c.row.update(input_bytes=dir_bytes(src), tensor_bytes=info["bytes"], tensors=info["tensors"],
                 shards=info["shards"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                 experts=cfg["n_routed_experts"], vocab=cfg["vocab_size"])
    w = opts["workers"]
    for rnd in range(opts["repeat"]):
        last = rnd == opts["repeat"] - 1
        c.step("cp", ["cp", "-r", str(src), str(cp_dst)], src, rnd)
        rm(cp_dst)
        c.step("cp+sync", ["bash", "-c", f"cp -r '{src}' '{cp_dst}' && sync"], src, rnd)
        rm(cp_dst)
        c.step("convert", [*GLMCONV, "convert", str(src), str(out1), "--json"], src, rnd)
        if not last:
            rm(out1)
        sync()
        c.step(f"convert-w{w}", [*GLMCONV, "convert", str(src), str(out2), "--workers", str(w), "--json"], src, rnd)
        rm(out2)
        c.step("cp-again", ["cp", "-r", str(src), str(cp_dst)], src, rnd)
        rm(cp_dst)
        if opts["cold"]:
            evict(src)
            c.step("cp-cold", ["cp", "-r", str(src), str(cp_dst)], src, rnd)
            rm(cp_dst)
            evict(src)
            c.step("convert-cold", [*GLMCONV, "convert", str(src), str(cold), "--json"], src, rnd)
            rm(cold)
    if opts["verify"] and out1.is_dir():
        for rnd in range(opts["repeat"]):
            c.step("verify", [*GLMCONV, "verify", str(src), str(out1), "--json"], src, rnd)
    if opts["profile"] and not fp8 and not opts.get("profiled"):
        opts["profiled"] = True
        c.row["profile"] = profile_convert(src, base / f"prof-{label}", c.logs)
    if out1.is_dir():
        c.row["output_bytes"] = dir_bytes(out1)
        if opts["export"]:
            exp, cp_m = base / f"export-{label}", base / f"cp-mcore-{label}"
            rm(exp, cp_m)
            for rnd in range(opts["repeat"]):
                c.step("cp-mcore", ["cp", "-r", str(out1), str(cp_m)], out1, rnd)
                rm(cp_m)
                c.step("export", [*GLMCONV, "export", str(out1), str(exp)], out1, rnd)
                if exp.is_dir():
                    c.row["export_bytes"] = dir_bytes(exp)
                rm(exp)
                if opts["relayout"]:
                    c.step("relayout", [*GLMCONV, "relayout", str(out1), str(exp), "--to", "mcore", "--json"], out1,
                           rnd)
                    rm(exp)
    if not opts["keep"]:
        rm(src, out1)
    return c.row


def profile_convert(src: Path, out: Path, logs: Path) -> dict[str, Any]:
    """cProfile (CPU time, so other processes do not distort it) of one single-process convert."""
    import pstats

    prof = logs / "convert.prof"
    rm(out)
    code = ("import cProfile, runpy, sys, time; sys.argv = ['glmconv'] + sys.argv[1:]; "
            "p = cProfile.Profile(time.process_time); p.enable()\n"
            "try:\n    runpy.run_module('glmconv', run_name='__main__')\n"
            f"except SystemExit:\n    pass\np.disable(); p.dump_stats({str(prof)!r})")
    r = run_timed("profile-convert", [PY, "-c", code, "convert", str(src), str(out), "--json"], logs)
    rm(out)
    result: dict[str, Any] = {"wall_seconds": r["seconds"], "rc": r["rc"], "timer": "process_time"}
    if prof.exists():
        stats = pstats.Stats(str(prof))
        rows = [{"function": f"{Path(file).name}:{line}({fn})", "calls": nc, "tottime": round(tt, 3),
                 "cumtime": round(ct, 3)}
                for (file, line, fn), (_, nc, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
        result["total_cpu_seconds"] = round(stats.total_tt, 3)  # type: ignore[attr-defined]
        result["top_tottime"] = sorted(rows, key=lambda x: -x["tottime"])[:15]
        result["top_cumtime"] = sorted(rows, key=lambda x: -x["cumtime"])[:30]
    return result


def has_command(name: str) -> bool:
    out = subprocess.run([*GLMCONV, "--help"], capture_output=True, text=True, cwd=ROOT, check=False).stdout
    return any(line.split()[:1] == [name] for line in out.splitlines())


# ---- the report ---------------------------------------------------------------------------------------

def machine(base: Path) -> dict[str, Any]:
    du = shutil.disk_usage(base)
    mount = max((p for p in psutil.disk_partitions(all=True) if str(base.resolve()).startswith(p.mountpoint)),
                key=lambda p: len(p.mountpoint), default=None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                            check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=ROOT, check=False).stdout.strip()
    return {"date": dt.date.today().isoformat(), "commit": commit + ("+dirty" if dirty else ""),
            "cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "disk": {"device": mount.device if mount else None, "fstype": mount.fstype if mount else None,
                     "mount": mount.mountpoint if mount else None, "opts": mount.opts if mount else None,
                     "total_bytes": du.total, "free_bytes": du.free},
            "python": platform.python_version(), "kernel": platform.release(), "loadavg_at_start": os.getloadavg()}


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def summarize(row: dict[str, Any]) -> None:
    """Per step: fastest and median round; throughput; ratio = cp seconds / step seconds (1.0 = as fast as cp)."""
    steps = row["steps"]
    for name, s in steps.items():
        ok = [r for r in s["runs"] if r["rc"] == 0]
        if not ok:
            continue
        secs = [r["seconds"] for r in ok]
        s.update(seconds_min=min(secs), seconds_median=round(statistics.median(secs), 3),
                 cpu_seconds_median=round(statistics.median(r["cpu_seconds"] for r in ok), 2),
                 others_cores_median=round(statistics.median(r["others_cores"] or 0 for r in ok), 2),
                 peak_rss_bytes=max(r["peak_rss_bytes"] for r in ok),
                 peak_rss_minus_shared_bytes=max(r["peak_rss_minus_shared_bytes"] for r in ok),
                 input_resident_before=statistics.median(r["input_resident_before"] or 0 for r in ok)
                 if any(r["input_resident_before"] is not None for r in ok) else None)
        nbytes = row.get("output_bytes") if name in ("cp-mcore", "export", "relayout") else row.get("input_bytes")
        s["gb_per_s"] = round(nbytes / s["seconds_min"] / 1e9, 3) if nbytes else None

    def ref(*names: str, key: str = "seconds_min") -> float | None:
        vals = [steps[n][key] for n in names if key in steps.get(n, {})]
        return min(vals) if vals else None

    for name, s in steps.items():
        if "seconds_min" not in s:
            continue
        if name.startswith("convert"):
            cps = ("cp-cold",) if name == "convert-cold" else ("cp", "cp-again")
            s["ratio_vs_cp"] = _ratio(ref(*cps), s["seconds_min"])
            s["ratio_vs_cp_median"] = _ratio(ref(*cps, key="seconds_median"), s["seconds_median"])
            s["ratio_vs_cp_sync"] = _ratio(ref("cp+sync"), s["seconds_min"])
        elif name in ("export", "relayout"):
            s["ratio_vs_cp"] = _ratio(ref("cp-mcore"), s["seconds_min"])
            s["ratio_vs_cp_median"] = _ratio(ref("cp-mcore", key="seconds_median"), s["seconds_median"])
        elif name == "verify":
            s["ratio_vs_convert"] = _ratio(ref("convert"), s["seconds_min"])
            s["ratio_vs_convert_median"] = _ratio(ref("convert", key="seconds_median"), s["seconds_median"])


def table(rows: list[dict[str, Any]]) -> str:
    cols = ("case", "step", "rounds", "fastest s", "median s", "GB/s", "ratio vs cp", "ratio (median)",
            "vs cp+sync", "vs convert (median)", "CPU s", "others (cores)", "peak RSS tree", "RSS - shared",
            "input cached")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        for name, s in row["steps"].items():
            if "seconds_min" not in s:
                lines.append(f"| {row['case']} | {name} | failed |" + " |" * (len(cols) - 3))
                continue
            cells = [row["case"], name, str(len(s["runs"])), f"{s['seconds_min']:.2f}", f"{s['seconds_median']:.2f}",
                     _fmt(s.get("gb_per_s")), _fmt(s.get("ratio_vs_cp")), _fmt(s.get("ratio_vs_cp_median")),
                     _fmt(s.get("ratio_vs_cp_sync")), _vs_convert(s), f"{s['cpu_seconds_median']:.1f}",
                     _fmt(s["others_cores_median"]),
                     f"{s['peak_rss_bytes'] / 2**30:.2f} GiB", f"{s['peak_rss_minus_shared_bytes'] / 2**30:.2f} GiB",
                     _fmt(s.get("input_resident_before"))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _vs_convert(s: dict[str, Any]) -> str:
    if s.get("ratio_vs_convert") is None:
        return ""
    return f"{_fmt(s['ratio_vs_convert'])} ({_fmt(s.get('ratio_vs_convert_median'))})"


def models(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | input bytes | hidden | layers (+MTP) | routed experts | vocab | tensors | shards "
             "| output bytes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "hidden" in r:
            lines.append(f"| {r['case']} | {r['input_bytes']:,} | {r['hidden']} | {r['layers']} (+1) | {r['experts']} "
                         f"| {r['vocab']} | {r['tensors']} | {r['shards']} | {r.get('output_bytes', 0):,} |")
    return "\n".join(lines)


def _fmt(x: Any) -> str:
    return "" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def main() -> int:
    base = (ROOT / os.environ.get("BENCH_DIR", "bench-data")).resolve()
    base.mkdir(parents=True, exist_ok=True)
    sizes = [parse_size(s) for s in os.environ.get("BENCH_SIZES", "1GB,4GB").split(",") if s.strip()]
    fp8_sizes = [parse_size(s) for s in os.environ.get("BENCH_FP8_SIZES", "1GB").split(",") if s.strip()]
    opts: dict[str, Any] = {
        "workers": env_int("BENCH_WORKERS", 2), "repeat": max(1, env_int("BENCH_REPEAT", 3)),
        "cold": os.environ.get("BENCH_COLD", "1") == "1", "profile": os.environ.get("BENCH_PROFILE", "0") == "1",
        "keep": os.environ.get("BENCH_KEEP", "0") == "1", "export": has_command("export"),
        "relayout": has_command("relayout"), "verify": has_command("verify"),
        "quiet": (float(os.environ.get("BENCH_QUIET_S", "20")), float(os.environ.get("BENCH_QUIET_CORES", "0.5")))}
    results: dict[str, Any] = {"machine": machine(base), "options": dict(opts),
                               "env": {k: v for k, v in os.environ.items() if k.startswith("BENCH_")}, "cases": []}
    print(f"glmconv bench: BF16 {sizes}, FP8 {fp8_sizes}, {opts['repeat']} rounds, "
          f"export {'yes' if opts['export'] else 'no'}", flush=True)
    audit = Case("audit-names", base, opts)
    if REAL_CONFIG.exists():
        for rnd in range(opts["repeat"]):
            audit.step("audit-names", [*GLMCONV, "audit-names", str(REAL_CONFIG), "--fp8"], None, rnd)
        summarize(audit.row)
    results["audit_names_real_config"] = audit.row
    for size, fp8 in [(s, False) for s in sizes] + [(s, True) for s in fp8_sizes]:
        row = run_case(size, fp8, base, opts)
        summarize(row)
        results["cases"].append(row)
        (base / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    results["options"].pop("profiled", None)
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    (base / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(models(results["cases"]))
    print()
    print(table([audit.row, *results["cases"]] if audit.row["steps"] else results["cases"]))
    print(f"\nresults: {base / 'results.json'}")
    failed = [f"{r['case']}:{n}" for r in [audit.row, *results["cases"]] for n, s in r["steps"].items()
              if any(x["rc"] for x in s["runs"])]
    if failed:
        print(f"failed steps: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
