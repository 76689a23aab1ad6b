#!/usr/bin/env bash
# On the lent GPU (device tool): `parity --train-backend megatron` at real dimensions (issue 37), beside the
# glmconv backend in the same call. `real-cut4` (the release's dims, layers 0-3: KDA x3 dense, DSA + MoE) is made
# in BF16 and converted to the mcore layout there; parity runs bf16, --stream-layers, at 4,096 tokens in two
# packed sequences (3,072 + 1,024), both modes, each backend, aligned conventions (--train-conventions serve).
# Usage: bash benchmarks/gpu_megatron.sh STEP...
#   sites: unpack .sites/*.tar.xz (scripts/pack-sites.sh), the wheels below in one call with the tree
#   whl | z3: install the carried .whl / .whl-z3 wheels (megatron-core is in .whl-z3; scripts/stage-wheels.sh)
#   make: fixture make + convert --layout mcore into $WORK, and the prompt file (HF_FROM=DIR: that real-cut4
#         source instead of a new BF16 one, e.g. /tmp/rc4/hf, the FP8 one gpu_verdict.sh made on the same machine)
#   tests: tests/gpu/test_megatron_backend_cuda.py (tiny fixtures carried in out/gpu: see gpu_verdict.sh)
#   propagated | isolated: that mode's two runs (megatron, then glmconv backend), wall times in $RES/times.txt
#   both: propagated isolated (the four runs; split them over two calls if one call's 10 minutes is short)
#   pack: $RES into $OUT/megatron.tgz
#   free: $WORK/mc removed (19 GB at real-cut4; see gpu_verdict.sh's free)
# A dry run of the steps on a CPU host: DEV=cpu PRESET=tiny LENGTHS="96 32" OUT=/tmp/out (the names keep what they say on the GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh && link_packages /tmp/glmconv-cli "$PWD"
SITE=/tmp/site:/tmp/site-z3
export PYTHONPYCACHEPREFIX=/tmp/pyc PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD:/tmp/glmconv-cli
WORK=${WORK:-/tmp/mg4}
RES=${RES:-/tmp/megatron}
mkdir -p "$WORK" "$RES"
COMMON=(--device "${DEV:-cuda}" --dtype bf16 --stream-layers --train-conventions serve --prompt-file "$WORK/prompt.jsonl" --json)
parity() {  # parity NAME ARGS...: time one run
  local name=$1; shift
  rm -rf "${RES:?}/$name"
  /usr/bin/time -f "$name wall %e s, peak RSS %M KB" -a -o "$RES/times.txt" \
    python3 -m glmconv parity "$WORK/hf" "$WORK/mc" "${COMMON[@]}" --report-dir "$RES/$name" "$@" \
    > "$RES/$name.json" 2> "$RES/$name.err"
  echo "$name rc=$?" >> "$RES/times.txt"
  tail -n 3 "$RES/$name.err"
}
for step in "$@"; do
  case $step in
    sites|whl|z3) packages "$step" ;;  # benchmarks/gpu_env.sh
    make)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
        python3 -c "import sys, torch, megatron.core as m; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, m.__version__)"
        python3 -c "import fast_hadamard_transform" 2>/dev/null && echo "fast_hadamard_transform: installed" \
          || echo "fast_hadamard_transform: absent (torch stand-in)"; } > "$RES/env.txt" 2>&1
      rm -rf "$WORK/hf" "$WORK/mc"
      if [ -n "${HF_FROM:-}" ]; then ln -sfn "$HF_FROM" "$WORK/hf"  # e.g. gpu_verdict.sh's FP8 real-cut4
      else /usr/bin/time -f "fixture wall %e s" -a -o "$RES/times.txt" \
        python3 -m glmconv fixture make "$WORK/hf" --preset "${PRESET:-real-cut4}" --seed 0 > "$RES/fixture.txt" 2>&1
      fi
      /usr/bin/time -f "convert wall %e s" -a -o "$RES/times.txt" \
        python3 -m glmconv convert "$WORK/hf" "$WORK/mc" --layout mcore --workers auto > "$RES/convert.txt" 2>&1
      python3 -c "
import json, random, sys
r, vocab = random.Random(0), json.load(open(sys.argv[1]))['text_config']['vocab_size']
print('\n'.join(json.dumps([r.randrange(vocab) for _ in range(int(n))]) for n in sys.argv[2:]))" \
        "$WORK/hf/config.json" ${LENGTHS:-3072 1024} > "$WORK/prompt.jsonl" ;;
    tests) GLMCONV_GPU_FIXTURES=$PWD/out/gpu python3 -m pytest -q -p no:cacheprovider \
             tests/gpu/test_megatron_backend_cuda.py > "$RES/gpu-tests.txt" 2>&1
           echo "gpu tests rc=$?" >> "$RES/times.txt"; tail -n 5 "$RES/gpu-tests.txt" ;;
    propagated|isolated)  # one mode, both backends, one after the other on the same machine
      parity "megatron-$step" --mode "$step" --train-backend megatron
      parity "glmconv-$step" --mode "$step" --train-backend glmconv ;;
    both) bash "$0" propagated isolated ;;
    free) rm -rf "${WORK:?}/mc"; df -h "$WORK" | tail -n 1 ;;
    pack) keep_tracebacks "$RES"; tar -czf "$OUT/megatron.tgz" -C "$RES" . && cat "$RES/times.txt" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
