# All targets create the local virtual environment .venv on first use and install kjit into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## run: the main job on the embedded default
run: $(STAMP)
	$(PY) -m kjit.cli demo

## test: the fast test suite
test: $(STAMP)
	$(PY) -m pytest -q

## test-slow: the slow tests only
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) benchmarks/oracles.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
