# pdops: two commands on a fresh Debian 12 machine (as root): `make demo`, `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdops-installed
TORCH := torch==2.13.0
SGLANG := sglang==0.5.23

.PHONY: env test test-unit test-lab demo clean-lab bench

env: $(STAMP)

$(STAMP): pyproject.toml requirements/contract.txt scripts/setup-system.sh
	bash scripts/setup-system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# CPU build from the local file; plain `torch` would fetch a CUDA build.
	$(PY) -m pip install -q $(TORCH)
	# SGLang for its argument parser only: no deps, then its import-time modules.
	$(PY) -m pip install -q --no-deps $(SGLANG)
	$(PY) -m pip install -q -r requirements/contract.txt
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/pytest -ra -p no:cacheprovider tests

test-unit: $(STAMP)
	$(VENV)/bin/pytest -ra -p no:cacheprovider tests/unit tests/contract

demo: $(STAMP)
	$(VENV)/bin/inv demo

bench: $(STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
