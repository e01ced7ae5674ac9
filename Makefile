# Every target creates the local virtual environment .venv on first use and installs kjit into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run demo test test-slow notebook bench docker-smoke clean

# one environment for everything: the library, the service, the tests and the notebook's extras
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,notebook,dask,redis]'
	touch $(STAMP)

## run: the main job — the message-operator service on 127.0.0.1:8000 with the default operators
##      (trained from the quadrature oracle on first start and cached in the store; docs at /docs)
run: $(STAMP)
	$(PY) -m kjit.cli serve

## demo: EP logistic regression on a UCI data set (banknote) with the quadrature operator and with a learned
##       just-in-time operator (kjit demo): test errors, EP iterations, oracle consultations, the posterior
demo: $(STAMP)
	$(PY) -m kjit.cli demo

## test: the fast test suite
# BLAS pinned to one thread: the suites are full of small matrices and loky worker processes,
# where multi-threaded BLAS on two cores oversubscribes (measured 10-20x slower under load).
# One pytest worker per core (pytest-xdist; TEST_WORKERS=0 runs the suite in this process), each test
# file in one worker, in order, as in a single process; the longest files first (tests/conftest.py).
TEST_WORKERS ?= auto
test: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

## test-slow: the slow tests only (notebook execution, the hostile-input fuzzer, the 5e5-particle oracle, ...)
test-slow: $(STAMP)
	OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m slow || [ $$? -eq 5 ]

## notebook: execute notebooks/train_operator.ipynb top to bottom (nbclient); the executed copy and the
##           figures go to notebooks/out/, the operator into the service's store (KJIT_STORE)
notebook: $(STAMP)
	$(PY) notebooks/execute.py

## bench: quick versions of every benchmark (JSON lines)
bench: $(STAMP)
	$(PY) -m kjit.cli bench --quick

## docker-smoke: build the image against a local Debian base and check /health and one messages request
##               (needs root: installs docker.io and debootstrap, starts dockerd; see scripts/docker-smoke)
docker-smoke:
	scripts/docker-smoke

clean:
	rm -rf $(VENV) build *.egg-info
