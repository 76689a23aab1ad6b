#!/usr/bin/env bash
# The main job on the embedded tiny model: make a fixture, audit it, convert, export, and run parity.
set -euo pipefail
cd "$(dirname "$0")/.."
G=".venv/bin/glmconv"
OUT=${DEMO_OUT:-out/demo}
MARK="$OUT/.glmconv-demo"
# Only a folder this script made (it holds the marker) is cleared: DEMO_OUT may point anywhere.
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && [ ! -f "$MARK" ]; then
  echo "error: $OUT exists and was not made by the demo; choose another DEMO_OUT" >&2
  exit 2
fi
rm -rf "$OUT" && mkdir -p "$OUT" && touch "$MARK"
echo "== glmconv fixture make (tiny, FP8 release layout, realistic init: residual streams at RMS ~2e-3)"
$G fixture make "$OUT/hf-tiny-fp8" --preset tiny --fp8 --seed 0
echo "== glmconv audit-names: the FP8 fixture against the plan its config implies"
$G audit-names "$OUT/hf-tiny-fp8"
echo "== glmconv audit-names: the real GLM-5.3-Flash config (76,108 tensors, FP8 + MTP + vision)"
$G audit-names fixtures/glm-5.3-flash.config.json --fp8
echo "== glmconv convert: HF -> Megatron torch_dist"
$G convert "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny"
echo "== glmconv audit-names --against: both sides and the mapping both ways"
$G audit-names "$OUT/hf-tiny-fp8" --against "$OUT/mcore-tiny"
echo "== glmconv export --fp8 --like: torch_dist -> HF in the release's naming, FP8 re-quantised exactly"
$G export "$OUT/mcore-tiny" "$OUT/hf-tiny-fp8-roundtrip" --fp8 --like "$OUT/hf-tiny-fp8"
$G audit-names "$OUT/hf-tiny-fp8-roundtrip" --against "$OUT/mcore-tiny"
echo "== glmconv parity: train (Megatron conventions, torch_dist) vs serve (HF conventions, safetensors)"
$G parity "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny" --report-dir "$OUT/parity" || true
echo "== glmconv parity, proj_rms=megatron alone: the eps form creates the divergence at layer 0 (the first fix the field made)"
$G parity "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny" --train-conventions serve --train-convention proj_rms=megatron \
  --report-dir "$OUT/parity-proj-rms" || true
echo "== glmconv parity --train-conventions serve --self-test: aligned conventions pass the verdict, and each planted"
echo "   defect of the catalog (conversion defects and convention slips) is named at its layer and sub-block"
$G parity "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny" --train-conventions serve --report-dir "$OUT/parity-aligned" \
  --self-test
echo "== glmconv relayout --to mcore: the same weights under megatron-core's native names (Megatron-Bridge, NeMo)"
$G relayout "$OUT/mcore-tiny" "$OUT/mcore-tiny-native" --to mcore
$G audit-names "$OUT/mcore-tiny-native" --against "$OUT/mcore-tiny"
$G verify "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny-native"
echo "== glmconv parity on the native layout, serve conventions but indexer_kpool=off (megatron-core's token-level"
echo "   DSA indexer, which has no kpool parameters): a sequence of 128 > index_topk 16 selects other tokens at layer 3"
$G parity "$OUT/hf-tiny-fp8" "$OUT/mcore-tiny-native" --train-conventions serve --train-convention indexer_kpool=off \
  --report-dir "$OUT/parity-native" || true
echo "demo OK: outputs in $OUT"
