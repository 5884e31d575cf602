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

.PHONY: setup run test test-slow lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(TEST_ENV) $(VENV)/bin/patchpar generate --model tiny --prompt "a photo of a red bag" \
		--steps 20 --seed 0 --out results/quickstart

test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q

test-slow: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check patchpar tests experiments
	$(VENV)/bin/ruff format --check patchpar tests experiments

clean:
	rm -rf $(VENV) .pytest_cache
