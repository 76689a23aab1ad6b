#!/usr/bin/env bash
# On the lent H200 (device tool): real-dimension parity. `real-cut4` (the release's dims, layers 0-3, FP8) is
# generated there (no transformers model classes needed), converted, and compared with
# `parity --device cuda --stream-layers` at 4096 tokens in two packed sequences: kernels on the train side,
# references on the serve side; once with the Megatron-port defaults, once with --train-conventions serve.
# Usage: bash benchmarks/gpu_real_cut4.sh STEP...
#   sites: unpack .sites/*.tar.xz (scripts/pack-sites.sh), the wheels below in one call with the tree
#   whl | z3: install the carried .whl / .whl-z3 wheels (two calls: 64 MiB per call; see scripts/stage-wheels.sh)
#   make: fixture make + convert into $WORK (timed, peak RSS); tests: tests/gpu/test_parity_cuda.py (fixtures
#   carried in out/gpu); parity: the two real-cut4 runs; summary: the figures RESULTS.md records.
# Results go to $OUT (default out/gpu-real-cut4); checkpoints to $WORK (default /tmp/rc4).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh && link_packages /tmp/glmconv-cli "$PWD"
export PYTHONPATH=/tmp/site:/tmp/site-z3:$PWD:/tmp/glmconv-cli PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONUNBUFFERED=1
export GLMCONV_GPU_FIXTURES=$PWD/out/gpu
OUT=${OUT:-out/gpu-real-cut4}
WORK=${WORK:-/tmp/rc4}
LAYERS=${LAYERS:-4}
mkdir -p "$OUT" "$WORK"
timed() {  # timed NAME CMD...: wall time and peak RSS of CMD into $OUT/times.txt, its output into $OUT/NAME.txt
  local name=$1; shift
  /usr/bin/time -f "$name wall %e s, peak RSS %M KB" -a -o "$OUT/times.txt" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name rc=$?" >> "$OUT/times.txt"
}
for step in "$@"; do
  case $step in
    sites|whl|z3) packages "$step" ;;  # benchmarks/gpu_env.sh
    make)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2
        python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"; } \
        > "$OUT/env.txt" 2>&1
      rm -rf "$WORK/hf" "$WORK/mc"
      timed fixture python3 -m glmconv fixture make "$WORK/hf" --preset real-cut4 --layers "$LAYERS" --fp8 --seed 0 --json
      timed convert python3 -m glmconv convert "$WORK/hf" "$WORK/mc" --json
      du -sb "$WORK/hf" "$WORK/mc" >> "$OUT/times.txt" ;;
    tests) python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_parity_cuda.py > "$OUT/gpu-tests.txt" 2>&1
           echo "gpu tests rc=$?" >> "$OUT/times.txt" ;;
    parity)  # 4096 tokens in two packed sequences of 3072 + 1024 (random ids, seed 0): the first is longer than
             # index_topk (2048), so the kpool indexer really selects; two equal halves of 2048 would select all
      python3 -c "
import json, random
r = random.Random(0)
print('\n'.join(json.dumps([r.randrange(154880) for _ in range(n)]) for n in (3072, 1024)))" > "$WORK/prompt.jsonl"
      for conv in ${CONVS:-default serve}; do
        rm -rf "$OUT/parity-$conv"
        timed "parity-$conv" python3 -m glmconv parity "$WORK/hf" "$WORK/mc" --device cuda --stream-layers --dtype bf16 \
          --prompt-file "$WORK/prompt.jsonl" --train-conventions "$conv" --report-dir "$OUT/parity-$conv" --json
      done ;;
    summary) python3 benchmarks/real_cut4_summary.py "$OUT" > "$OUT/summary.md" 2>&1; cat "$OUT/summary.md" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
cat "$OUT/times.txt" 2>/dev/null
