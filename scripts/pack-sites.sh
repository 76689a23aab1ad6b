#!/usr/bin/env bash
# The GPU machine's packages in one device call: the wheels of .whl and .whl-z3 (scripts/stage-wheels.sh) unpacked
# as `pip install --target` would and xz'd into .sites/ (about 39 MB, against 84 MB of wheels: the tree and both
# fit one call's 64 MiB). Unpacked there by benchmarks/gpu_env.sh's unpack_sites (the `sites` step of the scripts).
# The z3 command-line binary and C headers are left out: tilelang loads only the Python module and libz3.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/site" "$tmp/site-z3" .sites
for w in .whl/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
for w in .whl-z3/*.whl; do unzip -q -o "$w" -d "$tmp/site-z3"; done
rm -rf "$tmp"/site*/*.data "$tmp/site-z3/z3/include"
tar -C "$tmp" -cf - site | xz -9e -T0 > .sites/sites.tar.xz
tar -C "$tmp" -cf - site-z3 | xz -9e -T0 > .sites/z3.tar.xz
ls -la .sites
