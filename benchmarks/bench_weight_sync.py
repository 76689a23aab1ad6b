"""Weight-sync API speed and memory: `glmconv.hf_weights` streaming a converted checkpoint, as an RL trainer calls it.

Two ways in, each in a fresh process (peak RSS is the process's own): `dir` streams the torch_dist directory
(export's read path), `push` feeds the Megatron parameters already in memory in a shuffled order (the trainer's
case; its peak is reported above the RSS once the parameters are loaded). Prints one JSON line per round.

    python benchmarks/bench_weight_sync.py --preset cut8 --rounds 5
    python benchmarks/bench_weight_sync.py --preset bench --size 1GB --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _current_rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def one_round(mode: str, mc: Path) -> dict[str, object]:
    """Stream every HF tensor of `mc` once; tensors, bytes, seconds and memory."""
    import torch

    import glmconv
    from glmconv.io.torch_dist.reader import DcpReader

    torch.set_num_threads(1)
    base = 0.0
    if mode == "push":
        reader = DcpReader(mc)
        params = [(n, reader.read(n)) for n in reader.names()]
        random.Random(0).shuffle(params)
        base = _current_rss_gib()
        source: object = params
        config: object = mc / "config.json"
    else:
        source, config = mc, None
    start = time.perf_counter()
    tensors = nbytes = 0
    for _, tensor in glmconv.hf_weights(source, config):  # type: ignore[arg-type]
        tensors += 1
        nbytes += tensor.numel() * tensor.element_size()
    elapsed = time.perf_counter() - start
    return {"mode": mode, "tensors": tensors, "bytes": nbytes, "s": round(elapsed, 4),
            "tensors_per_s": round(tensors / elapsed), "gb_per_s": round(nbytes / elapsed / 1e9, 3),
            "peak_rss_gib": round(_rss_gib(), 3), "params_rss_gib": round(base, 3)}


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="cut8")
    ap.add_argument("--size", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round", nargs=2, metavar=("MODE", "MCORE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.round:
        print(json.dumps(one_round(args.round[0], Path(args.round[1]))))
        return
    import glmconv
    from glmconv.fixtures import make_fixture

    with tempfile.TemporaryDirectory() as tmp:
        size = int(float(args.size[:-2]) * 1e9) if args.size else None
        hf = make_fixture(Path(tmp) / "hf", args.preset, size=size)
        glmconv.convert(hf, Path(tmp) / "mc")
        for mode in ("dir", "push"):
            runs = []
            for _ in range(args.rounds):
                load = _load()
                out = subprocess.run([sys.executable, __file__, "--round", mode, str(Path(tmp) / "mc")],
                                     capture_output=True, text=True, check=True).stdout
                runs.append({**json.loads(out), "load_before": load})
                print(json.dumps(runs[-1]), flush=True)
            rates = [r["tensors_per_s"] for r in runs]
            print(json.dumps({"mode": mode, "preset": args.preset, "size": args.size, "best_tensors_per_s": max(rates),
                              "median_tensors_per_s": statistics.median(rates),
                              "peak_rss_gib": max(r["peak_rss_gib"] for r in runs)}), flush=True)


if __name__ == "__main__":
    main()
