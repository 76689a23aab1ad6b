#!/usr/bin/env bash
# The main job on the embedded tiny model: make a fixture, audit it, and each later stage as it lands.
set -euo pipefail
cd "$(dirname "$0")/.."
G=".venv/bin/glmconv"
OUT=${DEMO_OUT:-out/demo}
rm -rf "$OUT" && mkdir -p "$OUT"
echo "== glmconv fixture make (tiny, FP8 release layout)"
$G fixture make "$OUT/hf-tiny-fp8" --preset tiny --fp8 --seed 0
echo "== glmconv audit-names: the FP8 fixture against the plan its config implies"
$G audit-names "$OUT/hf-tiny-fp8"
echo "== glmconv audit-names: the real GLM-5.3-Flash config (76,108 tensors, FP8 + MTP + vision)"
$G audit-names ../shared/reference/glm-5.3-flash.config.json --fp8
if $G --help | grep -q "^  convert"; then
  echo "== glmconv convert: HF -> Megatron torch_dist"
  $G convert "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny"
  echo "== glmconv audit-names --against: both sides and the mapping both ways"
  $G audit-names "$OUT/hf-tiny-fp8" --against "$OUT/mcore-tiny"
fi
if $G --help | grep -q "^  export"; then
  echo "== glmconv export --fp8 --like: torch_dist -> HF in the release's naming, FP8 re-quantised exactly"
  $G export "$OUT/mcore-tiny" "$OUT/hf-tiny-fp8-roundtrip" --fp8 --like "$OUT/hf-tiny-fp8"
  $G audit-names "$OUT/hf-tiny-fp8-roundtrip" --against "$OUT/mcore-tiny"
fi
if $G --help | grep -q "^  parity"; then
  echo "== glmconv parity: train (Megatron conventions, torch_dist) vs serve (HF conventions, safetensors)"
  $G parity "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny" --report-dir "$OUT/parity" || true
  echo "== glmconv parity --train-conventions serve: aligned conventions must agree to fp32 noise"
  $G parity "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny" --train-conventions serve --report-dir "$OUT/parity-aligned" \
    --fail-on 'logprob_abs_diff.max>1e-4'
fi
echo "demo OK: outputs in $OUT"
