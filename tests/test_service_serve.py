"""`kjit serve`, the main job: first start trains the default operators from the quadrature
oracle with a progress bar and caches them in the store; later starts load them; it prints the
docs URL.  The test shrinks the defaults through the environment; the real defaults' first start
(four operators, 4000 pairs each, D 500/1000) and EP against it are ``benchmarks/ep_learned.py``
(too long for CI's machine and time limit as a test)."""

from __future__ import annotations

import subprocess
import sys

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
    srv = _serve(store, env).start()
    try:
        out = "".join(srv.output)
        assert "first start" in out and "oracle pairs" in out and "fitting" in out, out
        assert f"API docs: {srv.url}/docs" in out
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/docs").status_code == 200
            names = [o["name"] for o in c.get("/v1/operators").json()["operators"]]
            assert names == ["compound_gamma-tau", "logistic-x"]
            d = c.get("/v1/operators/logistic-x").json()
            assert d["n_train"] == 150 and d["training"]["threshold_source"]
            assert d["source"]["source"]["distribution"] == "default"
            assert srv.url.startswith("http://127.0.0.1:")
    finally:
        srv.stop()
    pairs = store / "training-sets" / "logistic-x.npz"
    assert pairs.exists()
    written = pairs.stat().st_mtime_ns
    srv = _serve(store, env).start()
    try:
        assert "first start" not in "".join(srv.output)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/v1/operators/logistic-x").json()["n_train"] == 150
    finally:
        srv.stop()
    assert pairs.stat().st_mtime_ns == written  # nothing was sampled or trained again


def test_cli_help_lists_serve_and_oracles_still_works():
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "--help"], capture_output=True, text=True)
    assert "serve" in out.stdout and "demo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "serve", "--help"], capture_output=True, text=True)
    assert "--store" in out.stdout and "--no-defaults" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kjit.cli", "oracles", "--particles", "2000"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "quadrature" in out.stdout
