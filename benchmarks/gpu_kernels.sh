#!/usr/bin/env bash
# On the lent H200 (device tool): the kernel tests, `glmconv bench kernels`, and parity with kernels on cut8.
# Wheels: `make gpu-wheels` here; on the machine, .whl into /tmp/site and .whl-z3 into /tmp/site-z3 (two calls,
# see scripts/stage-wheels.sh). Fixtures are made here and carried in out/gpu (the GPU machine's transformers
# lacks Glm5Next): glmconv fixture make out/gpu/hf-cut8 --preset cut8 --init unit && glmconv convert out/gpu/hf-cut8 out/gpu/mc-cut8
# (same for tiny). Usage: bash benchmarks/gpu_kernels.sh STEP...   STEP: kpool | tests | parity | bench | dsa
#   kpool: the triton indexer's tests and timings only (needs no fla / tilelang); tests: all of tests/gpu/test_kernels.py;
#   parity: cut8 parity with --kernels auto (fp32, bf16) and reference (bf16) + the CUDA parity tests; bench: the CLI;
#   dsa: the SparseMLA tests only. Results go to $OUT (default out/gpu-kernels).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh && link_packages /tmp/glmconv-cli "$PWD"
export PYTHONPATH=/tmp/site:/tmp/site-z3:$PWD:/tmp/glmconv-cli PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONUNBUFFERED=1
export GLMCONV_GPU_FIXTURES=$PWD/out/gpu
OUT=${OUT:-out/gpu-kernels}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } > "$OUT/env.txt" 2>&1
t() { python3 -m pytest -q -s -p no:cacheprovider "$@"; }
for step in "$@"; do
  s=$(date +%s)
  case $step in
    kpool) t tests/gpu/test_kernels.py -k kpool 2>&1 | tee "$OUT/tests-kpool.txt"
           python3 -c "
import json, torch
from glmconv.kernels.bench import bench_kpool, PACKED
torch.backends.cuda.matmul.allow_tf32 = False
with torch.inference_mode():
    for lengths in ([8192], list(PACKED)):
        print(json.dumps(bench_kpool(lengths).as_dict()))" 2>&1 | tee "$OUT/bench-kpool.txt" ;;
    tests) t tests/gpu/test_kernels.py 2>&1 | tee "$OUT/tests-kernels.txt" ;;
    dsa) t tests/gpu/test_kernels.py -k sparse_mla 2>&1 | tee "$OUT/tests-dsa.txt" ;;
    bench) python3 -m glmconv bench kernels --json > "$OUT/bench.json" 2> "$OUT/bench.err"; cat "$OUT/bench.json" ;;
    parity)
      for run in "auto fp32" "auto bf16" "reference bf16"; do
        set -- $run
        python3 -m glmconv parity out/gpu/hf-cut8 out/gpu/mc-cut8 --device cuda --kernels $1 --dtype $2 --tokens 512 \
          --sequences 4 --report-dir "$OUT/p-$1-$2" > "$OUT/parity-$1-$2.txt" 2>&1; echo "parity $1 $2 rc=$?"
        cp "$OUT/p-$1-$2/report.md" "$OUT/parity-$1-$2.md" 2>/dev/null; rm -rf "$OUT/p-$1-$2"
        grep -E "kernel error|first divergence|top-1" "$OUT/parity-$1-$2.txt"
      done
      t tests/gpu/test_parity_cuda.py 2>&1 | tail -5 | tee "$OUT/tests-parity-cuda.txt" ;;
  esac
  echo "step $step: $(( $(date +%s) - s )) s"
done
