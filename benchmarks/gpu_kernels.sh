#!/usr/bin/env bash
# On the lent H200 (device tool): the kernel tests, `glmconv bench kernels`, and parity with kernels on cut8.
# Wheels: `make gpu-wheels` here; on the machine, .whl into /tmp/site and .whl-z3 into /tmp/site-z3 (two calls,
# see scripts/stage-wheels.sh). Fixtures for parity are made here and carried in out/gpu (hf-cut8, mc-cut8).
# Usage: bash benchmarks/gpu_kernels.sh [kpool|all]   (kpool: the triton indexer only, no fla/tilelang needed)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:/tmp/site-z3:$PWD PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu-kernels}
mkdir -p "$OUT"
what=${1:-all}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git rev-parse --short HEAD 2>/dev/null;
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } > "$OUT/env-$what.txt" 2>&1
if [ "$what" = kpool ]; then
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_kernels.py -k kpool 2>&1 | tee "$OUT/tests-kpool.txt"
  python3 - <<'PY' 2>&1 | tee "$OUT/bench-kpool.txt"
import json, torch
from glmconv.kernels.bench import bench_kpool, PACKED
torch.backends.cuda.matmul.allow_tf32 = False
with torch.inference_mode():
    for lengths in ([8192], list(PACKED)):
        print(json.dumps(bench_kpool(lengths).as_dict()))
PY
  exit 0
fi
python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_kernels.py 2>&1 | tee "$OUT/tests-kernels.txt"
python3 -m glmconv bench kernels --json > "$OUT/bench.json" 2> "$OUT/bench.err"; cat "$OUT/bench.json" "$OUT/bench.err"
if [ -d out/gpu/hf-cut8 ]; then
  for k in auto reference; do
    python3 -m glmconv parity out/gpu/hf-cut8 out/gpu/mc-cut8 --device cuda --dtype bf16 --kernels $k --tokens 512 \
      --sequences 4 --report-dir "$OUT/parity-cut8-$k" > "$OUT/parity-cut8-$k.txt" 2>&1; echo "parity $k rc=$?"
    cat "$OUT/parity-cut8-$k.txt"
  done
fi
