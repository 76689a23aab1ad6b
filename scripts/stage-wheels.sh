#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (CPython 3.12, manylinux x86-64) into .whl/ and .whl-z3/ of this
# checkout (both git-ignored). The GPU machine has no network: carry .whl in one call and install it with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# then carry .whl-z3 (z3-solver alone is ~29 MB, tilelang loads it at import) in the next call into /tmp/site-z3,
# and run with PYTHONPATH=/tmp/site:/tmp/site-z3:$PWD PYTHONPYCACHEPREFIX=/tmp/pyc.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$@"; }
mkdir -p .whl .whl-z3
get .whl tilelang==0.1.15 "apache-tvm-ffi>=0.1.11,<0.1.13" torch-c-dlpack-ext==0.1.5 \
    fla-core==0.6.0 flash-linear-attention==0.6.0 megatron-core==0.19.2
get .whl-z3 "z3-solver>=4.13.0,<4.15.5"
# what tests/conftest.py imports beyond pytest (tests/gpu on the device; 2026-12-06 it stopped there without jsonschema)
get .whl-z3 jsonschema jsonschema-specifications referencing rpds-py attrs hypothesis sortedcontainers
# benchmarks/export_profile.py's profiler (every thread of an export, on the GPU machine)
get .whl-z3 yappi
du -sh .whl .whl-z3
