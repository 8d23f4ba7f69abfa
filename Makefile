# Every target creates its own virtual environment in .venv and installs what it needs.
# torch==2.13.0 goes in first: it is the CPU build, so nothing asks pip for a multi-GB CUDA build.
PYTHON ?= python3
# Data files (WikiText-2, stories260K, ...) are read from here; override with DATA_DIR=... or $ATTNLAB_DATA.
DATA_DIR ?= ../shared/data
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The attention zoo side by side (seconds), then the quickstart manifest: four attention kinds trained on
# WikiText-2 and compared on held-out text (about 6 minutes; finished runs in runs/ are reused).
demo: $(STAMP)
	$(PY) -m attnlab.demo --data-dir $(DATA_DIR)
	$(VENV)/bin/attnlab run configs/quickstart.yml --data-dir $(DATA_DIR)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench

# One worker process per core (pytest-xdist), each test file on one worker (its module fixtures built once).
PYTEST_PARALLEL ?= -n auto --dist loadfile

# --durations: the slowest tests, so that a CI log says where the suite's time goes (README: under 10 minutes)
test: lint
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=25

# Everything but the tests marked slow (more than ~5 s each, or a big model): for the edit-test loop.
test-fast: lint
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not slow"

bench: $(STAMP)
	$(PY) bench/train_step.py
	$(PY) bench/decode.py
	$(PY) bench/quant_codec.py
	$(PY) bench/kv_decode.py
	$(PY) bench/memory.py

clean:
	rm -rf $(VENV) .pytest_cache
