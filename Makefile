# Two commands do all set-up on a fresh Debian-like machine:
#   make demo   installs the package and runs the main job (a real 2-process training run)
#   make test   installs the package with its test tools and runs the linter and the test suite
#               (what CI runs)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup setup-test data demo test lint bench clean

# setup: what the package needs (the demo); setup-test adds the test tools and the third-party
# libraries the integrations are tested against (transformers, lightning, ...).
setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# Real data from Debian: Fashion-MNIST (gzipped IDX files), the KJV Bible (`bible` program) and
# the GCIDE dictionary (dictd files: --data kjv+gcide).
data:
	@if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || ! command -v bible >/dev/null \
			|| [ ! -f /usr/share/dictd/gcide.dict.dz ]; then \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q dataset-fashion-mnist bible-kjv dict-gcide; \
	fi

lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports   # the layers of docs/design.md (contracts in pyproject.toml)

test: setup-test data lint
	$(PY) -m pytest

demo: setup data
	bash benchmarks/demo.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
