# Two commands on a fresh machine: `make demo` (installs, then runs the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench
install: $(STAMP)

# torch is pinned to the CPU build that this machine class has on disk; a user with GPUs
# installs their own torch (any >= 2.2) and then `pip install -e .`.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[torch,demo,dev,lightning,accelerate]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/cannikin demo

lint: install
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q

bench: install
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done
