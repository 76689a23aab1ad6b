#!/usr/bin/env bash
# CI gate, run the way users run it: make the tiny fixture, convert it, and require train-vs-serve parity with
# aligned conventions (--train-conventions serve), judged by the verdict (no --fail-on: a named divergence fails),
# with the planted-defect catalog run in the same pass (--self-test: every defect must be named, or the run fails).
#
# The verdict is calibrated in the run: each side is also run as its fp32 torch-reference twin, so each sub-block
# carries its own noise; on CPU in fp32 an aligned pair is bit-identical (rel err 0 everywhere), and a divergence is
# named when the references differ by more than 1e-5 (a rounding-sized convention at fp32 stays ~1e-6) or the
# weights differ at all. Extra arguments go to `glmconv parity` (e.g. --train-convention hc_mix=bf16 to watch it fail).
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
echo "== parity: aligned conventions, fp32, propagated, with the planted-defect self-test"
$G parity "$WORK/hf-tiny" "$WORK/mcore-tiny" --train-conventions serve --tokens "${TOKENS:-128}" \
  --sequences "${SEQUENCES:-2}" --seed 0 --mode propagated --dtype fp32 --self-test \
  --report-dir "$REPORT_DIR" "$@"
echo "parity gate OK: report in $REPORT_DIR"
