# One command per job (docs/design.md#conventions). Everything runs from .venv, which is
# created from pyproject.toml on first use, so a fresh clone needs only python3 and go.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PACKAGES := api driver kubeletplugin controller
PYTEST_ARGS ?=

.PHONY: all venv test lint unit e2e protos image demo bench bench-scale bench-churn clean

all: test

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# mypy cannot follow setuptools' editable import hook, so it reads the packages
# through a tree of links that spells the drasil.* names.
.mypy-path: $(STAMP)
	rm -rf $@ && mkdir -p $@/drasil
	for p in $(PACKAGES); do ln -s ../../$$p $@/drasil/$$p; done

lint: $(STAMP) .mypy-path
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	MYPYPATH=.mypy-path $(BIN)/mypy $(addprefix -p drasil.,$(PACKAGES))
	MYPYPATH=.mypy-path $(BIN)/mypy e2e bench tools
	$(BIN)/lint-imports

unit: $(STAMP)
	$(BIN)/pytest tests $(PYTEST_ARGS)

e2e: $(STAMP)
	$(BIN)/pytest e2e $(PYTEST_ARGS)

# pytest exits 5 when it collected no test; make treats that as the failure it is. The
# 30 slowest tests are listed at the end: a warm run must stay under 30 minutes.
test: lint
	$(BIN)/pytest tests e2e --durations=30 $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python -m drasil.api.kubelet.protos generate

# The Dockerfile built with buildah (installed when missing), from a base made of
# Debian's packages: localhost/drasil:<version> and dist/drasil-<version>.oci.tar.
image: $(STAMP)
	$(BIN)/python -m tools.image build --dist dist

demo: $(STAMP)
	$(BIN)/python -m tools.demo

bench: $(STAMP)
	$(BIN)/python -m bench

# A KWOK fleet of 50, 200 and 500 nodes (docs/scale.md); e.g.
# make bench-scale BENCH_SCALE_ARGS="--nodes 50,200 --idle-minutes 3"
BENCH_SCALE_ARGS ?=
bench-scale: $(STAMP)
	$(BIN)/python -m bench.scale $(BENCH_SCALE_ARGS)

# The churn of e2e/test_churn.py with the load going BENCH_CHURN_ARGS' --seconds
# (default 300) after each disruption (docs/upgrading.md); e.g. BENCH_CHURN_ARGS="--seconds 120"
BENCH_CHURN_ARGS ?=
bench-churn: $(STAMP)
	$(BIN)/python -m bench.churn $(BENCH_CHURN_ARGS)

clean:
	rm -rf $(VENV) .mypy-path .mypy_cache .pytest_cache .ruff_cache .hypothesis build dist *.egg-info

# The GPU check (docs/gpu-check.md). `make gpu-check` runs build/gpu-check/run.py with
# this machine's python3 (3.10+), building the bundle first where it is missing (that
# needs PyPI); GPU_CHECK_ARGS go to the check, e.g. GPU_CHECK_ARGS="--nvidia-driver-root
# /run/nvidia/driver". GPU_CHECK_MOCK=1 (or `make gpu-check-mock`) checks a fake driver
# root whose NVML is the mock of e2e/harness/mocknvml, here, without a GPU (needs root).
GPU_CHECK_ARGS ?=
GPU_CHECK_MOCK ?=
GPU_BUNDLE := build/gpu-check

.PHONY: gpu-check gpu-check-bundle gpu-check-mock

gpu-check-bundle: $(STAMP)
	$(BIN)/python -m tools.gpubundle $(GPU_BUNDLE)

gpu-check:
	@test -f $(GPU_BUNDLE)/run.py || $(MAKE) gpu-check-bundle
	@if [ "$(GPU_CHECK_MOCK)" = 1 ]; then \
	  $(MAKE) $(STAMP) >/dev/null && \
	  args=$$($(BIN)/python -m e2e.harness.mocknvml.smi make-root build/gpu-check-mock) || exit 1; \
	fi; \
	$(PYTHON) $(GPU_BUNDLE)/run.py $$args $(GPU_CHECK_ARGS)

# Here the sources may have changed since the last bundle: build it again (seconds, with
# the wheels cached). A GPU machine runs the bundle it was given.
gpu-check-mock: gpu-check-bundle
	$(MAKE) gpu-check GPU_CHECK_MOCK=1
