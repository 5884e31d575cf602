# patchpar: `make run` (main job from nothing) and `make test` (set up, then the tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Offline: a hub lookup would hang for minutes on these machines.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Eight fake CPU devices for the patch-parallel tests and the quick start.
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu

# Fashion-MNIST (ground truth for FID) from Debian's package, installed when absent.
FMNIST := /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup run test test-slow lint clean

setup: $(STAMP) $(FMNIST)

$(FMNIST):
	$(SUDO) apt-get install -y -q dataset-fashion-mnist || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q dataset-fashion-mnist) || \
		{ echo "could not install Debian's dataset-fashion-mnist; put its four *-ubyte.gz files in $(dir $(FMNIST))"; exit 1; }

# uv installs the same pins as pip in half the time (32-37 s against 69 s from nothing on a
# 2-core machine); where uv cannot be installed or fails, pip does it. Neither writes bytecode for
# every file of every package (torch's many thousands: half of pip's time otherwise); Python
# writes it for what is imported, once.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if $(PY) -m pip install -q uv && \
		$(VENV)/bin/uv pip install -q --python $(PY) -c constraints.txt -e '.[dev]'; then :; else \
		echo "uv failed: installing with pip"; \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[dev]'; fi
	touch $(STAMP)

# Every strategy side by side on the tiny preset, 8 fake devices: table on stdout, records,
# images, plots and a grid image in runs/quickstart/ (re-made from scratch each time).
run: $(STAMP) $(FMNIST)
	rm -rf runs/quickstart
	$(TEST_ENV) $(VENV)/bin/patchpar sweep experiments/sweeps/quickstart.yaml
	$(TEST_ENV) $(VENV)/bin/patchpar plot runs/quickstart

# One pytest worker per core (at most 2: each worker's 8 fake devices use the cores too); a
# file's tests stay on one worker, so the reference runs it caches are computed once.
WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 2 ] && n=2; echo $$n)
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder

# The default tier compiles its programs with LLVM at -O0 and XLA:CPU's older loop emitters
# for fusions: the programs (the HLO patchpar builds, whose results, bytes and FLOPs the tests
# check) are the same, their machine code less optimised, and compiling them takes a third
# less time (the suite is mostly compiling; -O0 20-30%, the loop emitters 10% more). Every
# contract holds under either code generation. tests/conftest.py sets the same when pytest is
# run by hand. The slow tier (the XLA:CPU race canary among it), `make run` and every
# measurement compile as a user does.
TEST_XLA := XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" JAX_PLATFORMS=cpu

test: $(STAMP) $(FMNIST)
	$(TEST_XLA) $(PYTEST) --durations=15  # the slowest tests named: the suite keeps to 12 minutes

test-slow: $(STAMP) $(FMNIST)
	$(TEST_ENV) $(PYTEST) -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check patchpar tests experiments
	$(VENV)/bin/ruff format --check patchpar tests experiments

clean:
	rm -rf $(VENV) .pytest_cache
