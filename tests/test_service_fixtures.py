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

import httpx
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


def small_store(root, name: str, factor: str, to: str, snapshot_every: int | None = None, prepare=None, **spec):
    """An opened store at ``root`` holding one small operator ``name`` (``train_operator`` with
    threshold 0, seed 0, and ``spec`` — n 300, D 50/100 by default); ``prepare(jit)`` may change it
    before it is stored.  The caller closes the store."""
    spec = {"n": 300, "n_inner": 50, "n_outer": 100, "threshold": 0.0, "random_state": 0, **spec}
    store = OperatorStore(root, **({} if snapshot_every is None else {"snapshot_every": snapshot_every}))
    store.open()
    jit, _, info = train_operator(TrainSpec(factor, to, **spec))
    if prepare is not None:
        prepare(jit)
    store.create(name, jit, {"training": info, "threshold": jit.threshold})
    return store


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


def copy_store(src, dst):
    """A copy of the store ``src`` at ``dst`` (without its lock file: a store no server holds)."""
    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


@pytest.fixture
def store_dir(pristine_store, tmp_path):
    dst = tmp_path / "store"
    copy_store(pristine_store, dst)
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


def poll(get, done, timeout=900.0, every=0.05):
    """``get()`` until ``done(answer)`` or ``timeout`` seconds have passed (a hang guard sized for a
    slow machine); returns the last answer."""
    t_end = time.monotonic() + timeout
    failures = 0
    while True:
        try:
            answer = get()
        except httpx.TransportError:
            # a keep-alive connection the server closed as it was reused (on a starved machine the
            # client can sit idle past uvicorn's keep-alive): a read is safe to repeat, a few times
            failures += 1
            if failures > 5 or time.monotonic() > t_end:
                raise
            time.sleep(every)
            continue
        failures = 0
        if done(answer) or time.monotonic() > t_end:
            return answer
        time.sleep(every)


def wait_job(client, location, timeout=900.0, on_each=None) -> dict:
    """The job at ``location`` once it has finished (or the last record seen after ``timeout`` s)."""
    def get():
        job = client.get(location).json()
        if on_each is not None:
            on_each(job)
        return job
    return poll(get, lambda job: job["status"] in ("succeeded", "failed"), timeout)


def wait_ready(client, timeout=120.0):
    r = poll(lambda: client.get("/ready"), lambda r: r.status_code == 200, timeout, every=0.02)
    if r.status_code != 200:
        raise AssertionError(f"not ready: {r.text}")
    return r


@pytest.fixture
def app_client(store_dir):
    """In-process TestClient (for the many validation cases)."""
    from fastapi.testclient import TestClient

    app = create_app(settings_for(store_dir))
    with TestClient(app) as c:
        wait_ready(c)
        yield c
