# glmconv: one Makefile owns the environment. `make demo` and `make test` work on a fresh clone.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FLA_GUARD := $(VENV)/.fla-guard
SHELL := /bin/bash

.PHONY: env install demo test lint fuzz gate bench gpu-wheels clean

env: $(STAMP) $(FLA_GUARD)

# fla's kernels need a GPU: glmconv-fla-guard.pth hides fla where triton has no driver, so transformers' own
# Glm5Next runs its torch KDA on a CPU (glmconv/fla_guard.py).
# torch 2.13.0 comes from local disk (CPU wheel); megatron-core 0.19.2 declares python>=3.12 but its
# cp311 wheel works, so it is installed with --ignore-requires-python (on 3.12+ `pip install -e .[megatron]`).
$(STAMP): setup.cfg setup.py requirements-dev.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q --ignore-requires-python megatron-core==0.19.2 "numpy<2.4" triton psutil \
		transformers==5.23.0 safetensors click rich
	$(VPY) -m pip install -q tilelang==0.1.15 "apache-tvm-ffi>=0.1.11,<0.1.13" "z3-solver>=4.13.0,<4.15.5" \
		torch-c-dlpack-ext cloudpickle ml-dtypes tqdm
	$(VPY) -m pip install -q fla-core==0.6.0 flash-linear-attention==0.6.0 einops
	$(VPY) -m pip install -q -r requirements-dev.txt
	$(VPY) -m pip install -q --no-deps --ignore-requires-python -e .
	touch $(STAMP)

$(FLA_GUARD): $(STAMP) glmconv/fla_guard.py
	$(VPY) -c 'from glmconv.fla_guard import write_pth; print("wrote", write_pth())'
	touch $(FLA_GUARD)

# `glmconv` on PATH: a link to the venv's entry point in $(BINDIR) (default ~/.local/bin; BINDIR=/usr/local/bin).
BINDIR ?= $(HOME)/.local/bin
install: env
	mkdir -p $(BINDIR)
	ln -sf $(abspath $(VENV)/bin/glmconv) $(BINDIR)/glmconv
	@command -v glmconv >/dev/null || echo "note: $(BINDIR) is not on PATH; add it, or run $(abspath $(VENV)/bin/glmconv)"

demo: env
	bash scripts/demo.sh

# CI: lint, the parity gate the way users run it (fixture -> convert -> parity --fail-on), then the suite.
test: env lint gate
	$(VPY) -m pytest -q -n 2 --durations=15 tests

# ruff; the layer contract (.importlinter: layers, no cycles, counting imports inside functions); mypy (mypy.ini),
# which reads cli/ under the name it installs as, glmconv_cli: a link in mypy's own cache directory.
lint: env
	$(VENV)/bin/ruff check glmconv cli tests benchmarks scripts
	$(VENV)/bin/lint-imports --no-cache
	mkdir -p .mypy_cache/src && ln -sfn ../../cli .mypy_cache/src/glmconv_cli
	$(VENV)/bin/mypy

# The fuzz tests with fresh random examples, 20x the CI count (CI runs them derandomized: tests/helpers/fuzzing.py).
fuzz: env
	$(VPY) -m pytest -q -n 2 --hypothesis-profile=fuzz tests/*/test_fuzz_*.py

gate: env
	bash scripts/parity_gate.sh

bench: env
	bash benchmarks/run.sh

gpu-wheels:
	bash scripts/stage-wheels.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
