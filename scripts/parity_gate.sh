#!/usr/bin/env bash
# CI gate, run the way users run it: make the tiny fixture, convert it, and require train-vs-serve parity with
# aligned conventions (--train-conventions serve). Exits non-zero when any bound breaks (or any step fails).
#
# Bounds: with aligned conventions both sides compute the same math in fp32 (on CPU bit-identically: measured 0);
# a rounding-sized perturbation (proj_rms=megatron at the fixture's unit residual scale, a 4e-6 change of one
# normalisation per site) moves the log-probs by 5e-6 at most, so 1e-4 keeps more than a decade of margin for
# kernel-order noise, while every planted divergence moves them by 0.7 or more and flips top-1 somewhere.
# Extra arguments go to `glmconv parity` (e.g. --train-convention hc_mix=bf16 to watch the gate fail).
#   env: PY (python, default .venv/bin/python), WORK (scratch dir, default a fresh temp dir),
#        REPORT_DIR (default $WORK/parity-report), TOKENS (default 128), SEQUENCES (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-$(mktemp -d -t glmconv-parity-gate.XXXXXX)}
REPORT_DIR=${REPORT_DIR:-$WORK/parity-report}
mkdir -p "$WORK"
G="$PY -m glmconv"

echo "== fixture: tiny (seed 0) -> $WORK/hf-tiny"
$G fixture make "$WORK/hf-tiny" --preset tiny --seed 0 --force
echo "== convert: HF -> torch_dist"
rm -rf "$WORK/mcore-tiny"
$G convert "$WORK/hf-tiny" "$WORK/mcore-tiny"
echo "== parity: aligned conventions, fp32, propagated"
$G parity "$WORK/hf-tiny" "$WORK/mcore-tiny" --train-conventions serve --tokens "${TOKENS:-128}" \
  --sequences "${SEQUENCES:-2}" --seed 0 --mode propagated --dtype fp32 \
  --fail-on 'logprob_abs_diff.max>1e-4' --fail-on 'top1_agreement<1.0' --fail-on 'max_rel_err>1e-4' \
  --fail-on 'expert_overlap_min<1.0' --fail-on 'topk_overlap_min<1.0' \
  --report-dir "$REPORT_DIR" "$@"
echo "parity gate OK: report in $REPORT_DIR"
