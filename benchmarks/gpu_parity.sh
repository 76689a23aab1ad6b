#!/usr/bin/env bash
# On the lent H200 (device tool): tests/gpu, then parity timings on CUDA vs CPU for the tiny and cut8 fixtures.
# Fixtures are made here and carried in out/gpu (the GPU machine's transformers may lack Glm5Next):
#   glmconv fixture make out/gpu/hf-tiny --preset tiny --init unit && glmconv convert out/gpu/hf-tiny out/gpu/mc-tiny (same for cut8)
# Results go to $OUT (gpu-tests.txt, parity-*.json, timings.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh && link_packages /tmp/glmconv-cli "$PWD"
export PYTHONPATH=$PWD:/tmp/glmconv-cli${PYTHONPATH:+:$PYTHONPATH}
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
        python3 -m glmconv parity out/gpu/hf-$fx out/gpu/mc-$fx --device $dev --dtype $dt --train-conventions $conv --kernels reference \
          --tokens 512 --sequences 4 --json > "$OUT/parity-$fx-$dev-$dt-$conv.json" 2> "$OUT/parity-$fx-$dev-$dt-$conv.err"
        rc=$?; e=$(date +%s.%N)
        echo "$fx $dev $dt $conv rc=$rc wall=$(python3 -c "print(round($e-$s,2))")s" >> "$OUT/timings.txt"
      done
    done
  done
done
python3 - "$OUT" > "$OUT/summary.tsv" <<'PYEOF'
import glob, json, os, sys
print("run\tfirst_divergence\tmax_rel_err\ttop1\tlogprob_max\tkl\texpert_min\ttopk_min\trun_s")
for p in sorted(glob.glob(os.path.join(sys.argv[1], "parity-*.json"))):
    try:
        r = json.load(open(p))
    except (OSError, ValueError) as exc:
        print(f"{p}\tunreadable: {exc}")
        continue
    fd, layers, g = r["first_divergence"], r["layers"], r["logits"]
    ex = min(x.get("expert_overlap", 1.0) for x in layers)
    tk = min(x.get("topk_overlap", 1.0) for x in layers)
    first = (fd["layer"], fd["sub_block"], round(fd["value"], 5)) if fd else None
    print(f"{os.path.basename(p)[7:-5]}\t{first}\t{max(x['rel_err'] for x in layers):.3e}\t{g['top1_agreement']:.4f}"
          f"\t{g['logprob_abs_diff']['max']:.3e}\t{g['kl']:.3e}\t{ex:.3f}\t{tk:.3f}\t{r['elapsed_s']}")
PYEOF
tar czf "$OUT/parity-json.tgz" -C "$OUT" $(cd "$OUT" && ls parity-*) && rm -f "$OUT"/parity-*.json "$OUT"/parity-*.err
cat "$OUT/timings.txt" "$OUT/summary.tsv"; tail -15 "$OUT/gpu-tests.txt"
