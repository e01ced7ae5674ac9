"""Shared fixtures of the service and client tests (no tests here).

A session-wide "pristine" store holds three small operators (300 training pairs, D_in = 50,
D_out = 100, trained from the quadrature oracle in a few seconds); each test that changes
state gets its own copy.  The just-in-time thresholds are set to the median uncertainty on
fresh messages from the default distribution, so ``jit`` requests consult for some rows and
not for others.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from kjit.persistence import loads_state
from kjit.operators import JITOperator
from service import Settings, create_app
from service.store import OperatorStore
from service.testing import ThreadedServer
from service.training import DEFAULT_DISTRIBUTIONS, TrainSpec, train_operator

SMALL = {"logistic-x": ("logistic", "x"), "logistic-z": ("logistic", "z"), "compound_gamma-tau": ("compound_gamma", "tau")}
TOKEN = "s3cret-token"


def probe(factor_name: str, n: int = 40, seed: int = 123):
    return DEFAULT_DISTRIBUTIONS[factor_name](n, np.random.default_rng(seed))


def load_pristine(store_dir, name) -> JITOperator:
    """The operator as first written to the store (snapshot 0)."""
    data = (store_dir / "operators" / name / "snapshot-00000000.npz").read_bytes()
    kind, state = loads_state(data)
    assert kind == "JITOperator"
    return JITOperator.from_state_dict(state)


@pytest.fixture(scope="session")
def pristine_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "store"
    store = OperatorStore(root)
    store.open()
    try:
        for name, (factor, to) in SMALL.items():
            jit, _, info = train_operator(TrainSpec(factor, to, n=300, n_inner=50, n_outer=100, threshold=0.0,
                                                    random_state=0))
            _, logvar = jit.operator.predict(probe(factor, 400, seed=7))
            jit.threshold = float(np.median(logvar.max(axis=-1)))
            store.create(name, jit, {"training": info, "threshold": jit.threshold})
    finally:
        store.close()
    return root


@pytest.fixture
def store_dir(pristine_store, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(pristine_store, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


def settings_for(store_dir, **kw) -> Settings:
    base = dict(store=store_dir, token=TOKEN, max_batch=500, max_body_bytes=2_000_000, snapshot_every=1000)
    base.update(kw)
    return Settings(**base)


@pytest.fixture
def live(store_dir):
    """A real uvicorn server (thread) on a free loopback port, serving a fresh copy of the store."""
    with ThreadedServer(settings_for(store_dir)) as srv:
        yield srv


def wait_ready(client, timeout=30.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        r = client.get("/ready")
        if r.status_code == 200:
            return r
        time.sleep(0.02)
    raise AssertionError(f"not ready: {r.text}")


@pytest.fixture
def app_client(store_dir):
    """In-process TestClient (for the many validation cases)."""
    from fastapi.testclient import TestClient

    app = create_app(settings_for(store_dir))
    with TestClient(app) as c:
        wait_ready(c)
        yield c
