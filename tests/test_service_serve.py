"""`kjit serve`, the main job: first start trains the default operators from the quadrature
oracle with a progress bar and caches them in the store; later starts load them; it prints the
docs URL.  The fast test shrinks the defaults through the environment; the slow one runs the
real defaults (2000 pairs, D_in = 300, D_out = 500, three operators)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from service.testing import SubprocessServer

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")


def _serve(store, env, **kw):
    return SubprocessServer(store, env=env, train_defaults=True, **kw)


def test_first_start_trains_then_later_starts_load(tmp_path):
    store = tmp_path / "store"
    env = {"KJIT_DEFAULT_OPERATORS": "logistic-x,compound_gamma-tau", "KJIT_DEFAULT_N_TRAIN": "150",
           "KJIT_DEFAULT_N_INNER": "30", "KJIT_DEFAULT_N_OUTER": "50"}
    srv = _serve(store, env).start(timeout=300)
    try:
        out = "".join(srv.output)
        assert "first start" in out and "oracle pairs" in out and "fitting" in out, out
        assert f"API docs: {srv.url}/docs" in out
        with httpx.Client(base_url=srv.url) as c:
            assert c.get("/docs").status_code == 200
            names = [o["name"] for o in c.get("/v1/operators").json()["operators"]]
            assert names == ["compound_gamma-tau", "logistic-x"]
            d = c.get("/v1/operators/logistic-x").json()
            assert d["n_train"] == 150 and d["training"]["threshold_source"]
            assert d["source"]["source"]["distribution"] == "default"
            assert srv.url.startswith("http://127.0.0.1:")
    finally:
        srv.stop()
    assert (store / "training-sets" / "logistic-x.npz").exists()
    t0 = time.monotonic()
    srv = _serve(store, env).start(timeout=120)
    try:
        assert "first start" not in "".join(srv.output)
        with httpx.Client(base_url=srv.url) as c:
            assert c.get("/v1/operators/logistic-x").json()["n_train"] == 150
    finally:
        srv.stop()
    assert time.monotonic() - t0 < 60


def test_cli_help_lists_serve_and_oracles_still_works():
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "--help"], capture_output=True, text=True)
    assert "serve" in out.stdout and "demo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "serve", "--help"], capture_output=True, text=True)
    assert "--store" in out.stdout and "--no-defaults" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "oracles", "--particles", "2000"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "quadrature" in out.stdout


@pytest.mark.slow
def test_real_defaults_first_start(tmp_path):
    """The real first start (three operators, 2000 pairs each, D_in 300, D_out 500) and the EP
    run a user would do against it."""
    import numpy as np

    from kjit.client import RemoteOperator
    from kjit.datasets import paper_split
    from kjit.ep import BayesianLogisticRegression
    from kjit.factors import Logistic
    from kjit.oracles import QuadratureOracle

    store = tmp_path / "store"
    t0 = time.monotonic()
    srv = _serve(store, {}).start(timeout=900)
    first = time.monotonic() - t0
    try:
        print(f"first start: {first:.0f}s")
        split = paper_split("banknote", random_state=0, add_bias=True)
        with RemoteOperator(srv.url, "logistic-x") as op:
            m = BayesianLogisticRegression(op).fit(split.X_train, split.y_train)
            ref = BayesianLogisticRegression(QuadratureOracle(Logistic())).fit(split.X_train, split.y_train)
            print("consultations", op.counters())
        sd = np.sqrt(np.diag(ref.posterior_.cov))
        print("max |mean - mean_quadrature| / sd:", np.max(np.abs(m.coef_ - ref.coef_) / sd))
        # the learned operator's noise (held-out mean KL ~5e-3) keeps EP from meeting tol=1e-6, and moves
        # the posterior mean by a fraction of a posterior s.d.; the classifier is as good
        e, e_ref = m.test_error(split.X_test, split.y_test), ref.test_error(split.X_test, split.y_test)
        assert abs(e - e_ref) <= 0.01, (e, e_ref)
        assert np.max(np.abs(m.coef_ - ref.coef_) / sd) < 1.0
    finally:
        srv.stop()
