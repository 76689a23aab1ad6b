#!/usr/bin/env bash
# On the lent H200 (device tool): the calibrated parity verdict at real dimensions. `real-cut4` (the release's
# dims, layers 0-3, FP8) is generated and converted there, then `parity --device cuda --stream-layers` runs at
# 4,096 tokens in two packed sequences (3,072 + 1,024), kernels on the train side, aligned conventions, with the
# planted-defect catalog (`--self-test`) in one pass per run.
# Usage: bash benchmarks/gpu_verdict.sh STEP...
#   sites: unpack .sites/*.tar.xz (scripts/pack-sites.sh), the wheels below in one call with the tree
#   whl | z3: install the carried .whl / .whl-z3 wheels (two calls: 64 MiB per call; scripts/stage-wheels.sh)
#   make: fixture make + convert into $WORK and the prompt file
#   tests: tests/gpu/test_parity_verdict_cuda.py (tiny fixtures carried in out/gpu, made with --init unit)
#   run NAME [parity args...]: one parity run (report in $RES/NAME, wall time and exit code in $RES/times.txt)
#   old NAME [parity args...]: the same with the tree in bench-data/old (the baseline a ratio is taken against)
#   pack: $RES into $OUT/verdict.tgz (the device returns at most 8 files)
#   free: $WORK/mc removed (19 GB; the FP8 source $WORK/hf stays for gpu_megatron.sh / gpu_release.sh on the same
#         machine: the disk holds 64 GB, and 2026-12-06 the release runs found 17.8 GB free after these two)
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh && link_packages /tmp/glmconv-cli "$PWD" && link_packages /tmp/glmconv-cli-old "$PWD/bench-data/old"
SITE=/tmp/site:/tmp/site-z3
export PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONUNBUFFERED=1
WORK=${WORK:-/tmp/rc4}
RES=${RES:-/tmp/verdict}
mkdir -p "$WORK" "$RES"
COMMON=(--device cuda --stream-layers --prompt-file "$WORK/prompt.jsonl" --json)
parity() {  # parity TREE CLI NAME ARGS...: time one run of that tree's glmconv parity
  local tree=$1 cli=$2 name=$3; shift 3
  rm -rf "${RES:?}/$name"
  (cd "$tree" && PYTHONPATH=$SITE:$tree:$cli /usr/bin/time -f "$name wall %e s, peak RSS %M KB" -a \
    -o "$RES/times.txt" python3 -m glmconv parity "$WORK/hf" "$WORK/mc" "${COMMON[@]}" --report-dir "$RES/$name" "$@" \
    > "$RES/$name.json" 2> "$RES/$name.err")
  echo "$name rc=$?" >> "$RES/times.txt"
  tail -n 3 "$RES/$name.err"
}
step=$1; shift
case $step in
  sites|whl|z3) packages "$step" ;;  # benchmarks/gpu_env.sh
  make)
    export PYTHONPATH=$SITE:$PWD:/tmp/glmconv-cli
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
      python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"; } \
      > "$RES/env.txt" 2>&1
    rm -rf "$WORK/hf" "$WORK/mc"
    /usr/bin/time -f "fixture wall %e s" -a -o "$RES/times.txt" \
      python3 -m glmconv fixture make "$WORK/hf" --preset real-cut4 --fp8 --seed 0 > "$RES/fixture.txt" 2>&1
    /usr/bin/time -f "convert wall %e s" -a -o "$RES/times.txt" \
      python3 -m glmconv convert "$WORK/hf" "$WORK/mc" --workers auto > "$RES/convert.txt" 2>&1
    python3 -c "
import json, random
r = random.Random(0)
print('\n'.join(json.dumps([r.randrange(154880) for _ in range(n)]) for n in (3072, 1024)))" > "$WORK/prompt.jsonl" ;;
  tests) PYTHONPATH=$SITE:$PWD:/tmp/glmconv-cli GLMCONV_GPU_FIXTURES=$PWD/out/gpu python3 -m pytest -q \
           -p no:cacheprovider tests/gpu/test_parity_verdict_cuda.py > "$RES/gpu-tests.txt" 2>&1
         echo "gpu tests rc=$?" >> "$RES/times.txt"; tail -n 5 "$RES/gpu-tests.txt" ;;
  run) parity "$PWD" /tmp/glmconv-cli "$@" ;;
  old) parity "$PWD/bench-data/old" /tmp/glmconv-cli-old "$@" ;;
  free) rm -rf "${WORK:?}/mc"; df -h "$WORK" | tail -n 1 ;;
  pack) keep_tracebacks "$RES"; tar -czf "$OUT/verdict.tgz" -C "$RES" . && cat "$RES/times.txt" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
