# The two commands of the README: `make demo` and `make test`. Each sets itself up
# on a fresh machine: Debian packages, .venv, Python packages, the C extension.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed
SYSDEPS := $(VENV)/.sysdeps-installed
EXT    := ops/_block_copy.stamp

.PHONY: demo swap-demo test test-slow lint bench build clean

TRACE  := $(wildcard ../shared/traces/synthetic_trace.jsonl)

demo: build
	mkdir -p out
	$(PY) scripts/replay_trace.py $(if $(TRACE),--trace $(TRACE)) --plot out/replay.png

swap-demo: build
	$(PY) scripts/demo_swap.py

test: build lint
	$(PY) -m pytest -q -m "not slow"
	PY=$(PY) bash tests/run_unprivileged.sh  # as root: the `permissions` tests again, as uid 65534

test-slow: build  # the long scenarios `make test` leaves out (tests/conftest.py, SLOW_TESTS)
	$(PY) -m pytest -q -m slow

lint: $(DEPS)
	$(PY) -m pyflakes cache_manager ops transfer_factory engine_hooks tests

bench: build
	$(PY) scripts/bench_swap.py
	$(PY) scripts/bench_queue.py
	$(PY) scripts/bench_storage.py

build: $(EXT)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(SYSDEPS): requirements-apt.txt scripts/install_system_deps.sh | $(PY)
	bash scripts/install_system_deps.sh
	touch $@

$(DEPS): requirements.txt $(SYSDEPS) | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

$(EXT): $(DEPS) setup.py $(wildcard ops/csrc/*.c) $(wildcard transfer_factory/csrc/*.[ch]) $(wildcard transfer_factory/file/csrc/*.[ch]) $(wildcard cache_manager/queue/csrc/*.c) transfer_factory/csrc/sha256.h
	$(PY) setup.py -q build_ext --inplace
	touch $@

clean:
	rm -rf build ops/_block_copy*.so ops/_shm_atomic*.so transfer_factory/file/_records*.so cache_manager/queue/_wire_check*.so cache_manager/queue/_wire_seal*.so $(EXT)
