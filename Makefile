# Two commands on a fresh machine: `make run` (train on the embedded default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build lies on disk here. On a GPU machine install your CUDA torch into .venv first
# (e.g. `.venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu124`),
# or run `make TORCH_SPEC=torch run`: an already importable torch is kept.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.fivefold-installed

.PHONY: run test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/fivefold train --overwrite $(ARGS)

PYTEST_ARGS ?= --durations=30

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The tests that start no process (tests/conftest.py fails any that tries): about a minute.
test-fast: $(STAMP)
	FIVEFOLD_TEST_FAST=1 $(PY) -m pytest tests -m "not multiprocess" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check fivefold tests bench

bench: $(STAMP)
	$(PY) bench/run.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
