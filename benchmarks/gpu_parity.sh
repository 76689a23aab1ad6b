#!/usr/bin/env bash
# On the lent H200 (device tool): tests/gpu, then parity timings on CUDA vs CPU for the tiny and cut8 fixtures.
# Fixtures are made here and carried in out/gpu (the GPU machine's transformers may lack Glm5Next):
#   glmconv fixture make out/gpu/hf-tiny --preset tiny && glmconv convert out/gpu/hf-tiny out/gpu/mc-tiny (same for cut8)
# Results go to $OUT (gpu-tests.txt, parity-*.json, timings.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export GLMCONV_GPU_FIXTURES=$PWD/out/gpu
OUT=${OUT:-out/gpu-results}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"; } > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-index pytest >/dev/null 2>&1 || true
python3 -m pytest -q -s tests/gpu -p no:cacheprovider > "$OUT/gpu-tests.txt" 2>&1; echo "rc=$?" >> "$OUT/gpu-tests.txt"
for fx in tiny cut8; do
  for dev in cpu cuda; do
    for dt in fp32 bf16; do
      for conv in serve default; do
        s=$(date +%s.%N)
        python3 -m glmconv parity out/gpu/hf-$fx out/gpu/mc-$fx --device $dev --dtype $dt --train-conventions $conv \
          --tokens 512 --sequences 4 --json > "$OUT/parity-$fx-$dev-$dt-$conv.json" 2> "$OUT/parity-$fx-$dev-$dt-$conv.err"
        rc=$?; e=$(date +%s.%N)
        echo "$fx $dev $dt $conv rc=$rc wall=$(python3 -c "print(round($e-$s,2))")s" >> "$OUT/timings.txt"
      done
    done
  done
done
cat "$OUT/timings.txt"; tail -15 "$OUT/gpu-tests.txt"
