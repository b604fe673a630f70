# pdops: two commands on a fresh Debian 12 machine (as root): `make demo`, `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdops-installed
TORCH := torch==2.13.0
SGLANG := sglang==0.5.23
# The gateway's own environment (smg only: no torch, no SGLang), as on a production gateway host.
GATEWAY_VENV ?= .venv-gateway
SMG := smg==1.13.0
# Real SGLang on the lab's CPU (issue 50, docs/lab.md): its own environment, and the tiny model it
# serves (generated here with a fixed seed, never downloaded), where the lab's CPU profile reads it.
ENGINE_VENV ?= .venv-engine
ENGINE_STAMP := $(ENGINE_VENV)/.pdops-installed
LAB_MODEL := /var/lib/pdops-lab/models/tiny-qwen2
BENCH_VENV ?= .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.pdops-installed

.PHONY: env env-engine test test-fleet test-unit test-lab test-repeat demo clean-lab bench bench-env mutate soak

env: $(STAMP) $(ENGINE_STAMP)

env-engine: $(ENGINE_STAMP)

# SGLang with --no-deps (it pins torch 2.14.1), the CPU torch first from the local file, then the
# smallest set of its requirements that runs on CPU (requirements/engine-cpu.txt: 2.9 GB, not the
# 6.1 GB of every requirement), torch held by a constraint. The stand-ins for GPU-only packages are
# not installed: pdops renders them onto the engine's PYTHONPATH (pdops/lab/cpu_engine/standins).
$(ENGINE_STAMP): requirements/engine-cpu.txt scripts/setup-system.sh pdops/lab/cpu_engine/tiny_model.py
	bash scripts/setup-system.sh
	test -x $(ENGINE_VENV)/bin/python || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install -q $(TORCH)
	$(ENGINE_VENV)/bin/python -m pip install -q --no-deps $(SGLANG)
	echo "$(TORCH)" > $(ENGINE_VENV)/constraints.txt
	$(ENGINE_VENV)/bin/python -m pip install -q -c $(ENGINE_VENV)/constraints.txt -r requirements/engine-cpu.txt
	$(ENGINE_VENV)/bin/python pdops/lab/cpu_engine/tiny_model.py $(LAB_MODEL)
	touch $(ENGINE_STAMP)

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
	test -x $(GATEWAY_VENV)/bin/python || $(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/python -m pip install -q $(SMG)
	touch $(STAMP)

# Four pytest-xdist workers, a test file each at a time (module fixtures stay whole), handed out in
# the order tests/conftest.py sorts them (the longest lab modules first); each worker that reaches a
# lab test boots a lab of its own (lab slot = worker number: pdops.lab.slot). The suite keeps both
# cores busy (vmstat: 0-1 % idle in its first half): a fourth worker took the run from 19 min 38 s
# to 18 min 09 s on a fresh clone, every lab module a little longer (71 worker-min, was 58); a fifth
# took 16 min 36 s to 18 min 01 s (the machine under 1 % idle throughout: docs/bench.md).
TEST_WORKERS ?= 4
test: $(STAMP) $(ENGINE_STAMP)
	$(VENV)/bin/pytest -ra --durations=30 -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not fleet" tests

# The fleet-size lab tests (issue #35): deploy, status, verify and a drain on 32 lab hosts; about
# 3 minutes, too long for `make test`'s time goal. Lab slot: $PDOPS_LAB_SLOT (default 0).
test-fleet: $(STAMP)
	PDOPS_LAB_HOSTS=32 $(VENV)/bin/pytest -ra -p no:cacheprovider -m fleet tests/lab/test_fleet_lab.py

test-unit: $(STAMP)
	$(VENV)/bin/pytest -ra -p no:cacheprovider tests/unit tests/contract

# Flake finder: one test (or file) N times in a row, each in a fresh pytest (a lab test boots
# its own lab each time); prints the pass count and fails unless every run passed.
#   make test-repeat TEST=tests/lab/test_drain.py::test_drain_one_prefill N=5
N ?= 5
test-repeat: $(STAMP)
	@test -n "$(TEST)" || { echo "usage: make test-repeat TEST=tests/...py[::test_name] [N=5]" >&2; exit 2; }
	@passed=0; for i in $$(seq 1 $(N)); do \
	  if $(VENV)/bin/pytest -q -p no:cacheprovider $(TEST) > .test-repeat.log 2>&1; then passed=$$((passed + 1)); r=passed; \
	  else r="FAILED (tail below)"; tail -n 30 .test-repeat.log; fi; \
	  echo "run $$i of $(N): $$r"; done; rm -f .test-repeat.log; \
	echo "$(TEST): $$passed of $(N) runs passed"; test $$passed -eq $(N)

demo: $(STAMP)
	$(VENV)/bin/inv demo

# Compound failures: a seeded random sequence of operations and faults on a lab cluster under load
# (tests/lab/soak.py; not part of `make test`). Prints one line per operation and a summary.
SOAK_OPS ?= 100
SOAK_SEED ?= 1
SOAK_HOSTS ?= 5
SOAK_KINDS ?=
SOAK_SHAPE ?= one-gateway
# SOAK_SHAPE: one-gateway, or front-door (two gateways behind HAProxy, the record on etcd: tests/lab/soak.py)
# SOAK_KINDS: the kinds to draw from, comma-separated (empty: every kind tests/lab/soak.py knows)
soak: $(STAMP)
	PDOPS_LAB_HOSTS=$(SOAK_HOSTS) SOAK_OPS=$(SOAK_OPS) SOAK_SEED=$(SOAK_SEED) SOAK_KINDS=$(SOAK_KINDS) SOAK_SHAPE=$(SOAK_SHAPE) $(VENV)/bin/pytest -s -p no:cacheprovider --timeout 0 tests/lab/soak.py

# Flip each verifier's verdict to "yes" and show a test fails (not part of `make test`).
mutate: $(STAMP)
	$(PY) scripts/mutate.py

bench: $(STAMP) $(BENCH_STAMP)
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
	$(MAKE) test-fleet

# SGLang's own benchmark client, for bench/loadgen.py's comparison (not needed by `make test`).
# About 6 GB: torch 2.14.1 + torchvision 0.29.1 (the versions this machine's disk holds).
bench-env: $(BENCH_STAMP)

$(BENCH_STAMP): requirements/bench-compare.txt requirements/contract.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(BENCH_VENV)/bin/python -m pip install -q --no-deps $(SGLANG)
	$(BENCH_VENV)/bin/python -m pip install -q -r requirements/bench-compare.txt
	$(BENCH_VENV)/bin/python -c "import sglang.benchmark.serving"
	touch $(BENCH_STAMP)
