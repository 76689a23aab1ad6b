#!/usr/bin/env bash
# `make bench`: time glmconv convert (single process and --workers 2) against `cp -r` on bench fixtures, export and
# relayout against `cp -r` of the converted checkpoint, and verify against convert of the same source.
# Sizes: BENCH_SIZES (default 1GB,4GB, BF16) and BENCH_FP8_SIZES (default 1GB); data under BENCH_DIR
# (default bench-data, git-ignored), deleted as it goes unless BENCH_KEEP=1; results in BENCH_DIR/results.json.
# Needs about 4x the largest size free on that disk. See benchmarks/bench_convert.py for every knob.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export BENCH_DIR=${BENCH_DIR:-bench-data}
mkdir -p "$BENCH_DIR"
largest=$("$PY" - <<'PYEOF'
import os
from glmconv_cli.sizes import parse_size
sizes = [parse_size(s) for k in ("BENCH_SIZES", "BENCH_FP8_SIZES")
         for s in os.environ.get(k, "1GB,4GB" if k == "BENCH_SIZES" else "1GB").split(",") if s.strip()]
print(max(sizes, default=0))
PYEOF
)
free=$(df --output=avail -B1 "$BENCH_DIR" | tail -1)
if (( free < 4 * largest )); then
  echo "bench: $BENCH_DIR has $((free / 1000000000)) GB free, needs about $((4 * largest / 1000000000)) GB" >&2
  exit 2
fi
exec "$PY" benchmarks/bench_convert.py "$@"
