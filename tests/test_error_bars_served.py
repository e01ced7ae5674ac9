"""Draws of a served operator (``mode=predict&draw=seed``, ``RemoteOperator.draws``) and EP error bars through
them: the same draws, and the same error bars, as the operator's in process."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kjit.client import RemoteOperator, RemoteOperatorError
from kjit.ep import LinearEP
from kjit.families import Beta

from test_service_fixtures import (  # noqa: F401 - fixtures
    TOKEN,
    live,
    load_pristine,
    pristine_store,
    probe,
    store_dir,
)

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")


def test_served_draws_are_the_operators_draws(live, pristine_store):
    local = load_pristine(pristine_store, "logistic-x")
    inc = probe("logistic", 25)
    with RemoteOperator(live.url, "logistic-x", mode="predict") as op:
        served = op.draws(3, random_state=4, mean=True)
        here = local.draws(3, random_state=4, mean=True)
        for s, h in zip(served, here):
            assert s.belief(inc, "x") == h.belief(inc, "x")  # bit for bit: JSON carries doubles exactly
        assert served[0].belief(inc) == local.operator.belief(inc)
        assert not served[1].belief(inc) == served[2].belief(inc)


def test_served_error_bars_equal_the_in_process_ones(live, pristine_store):
    local = load_pristine(pristine_store, "logistic-x")
    rng = np.random.default_rng(0)
    A = rng.standard_normal((40, 3))
    y = (A @ np.array([1.0, -1.0, 0.5]) + rng.logistic(size=40)) > 0
    observed = {"z": Beta(np.where(y, 2.0, 1.0), np.where(y, 1.0, 2.0))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = LinearEP(local.operator, damping=0.3, error_bars=4).run(A, observed)
        with RemoteOperator(live.url, "logistic-x", mode="predict") as op:
            theirs = LinearEP(op, damping=0.3, error_bars=4).run(A, observed)
    assert mine.converged and theirs.converged
    assert theirs.error_bars.drawn == ["operator"] and theirs.error_bars.n_failed == 0
    assert theirs.error_bars.mean_sd == mine.error_bars.mean_sd
    assert theirs.error_bars.log_var_sd == mine.error_bars.log_var_sd


def test_a_draw_with_a_bad_seed_is_refused_and_a_draw_changes_nothing(live):
    import httpx

    inc = probe("logistic", 3)
    with RemoteOperator(live.url, "logistic-x", mode="predict") as op:
        body = {"to": "x", "incoming": {"x": {"family": "gaussian", "mean": inc["x"].mean().tolist(),
                                              "var": inc["x"].var().tolist()},
                                        "z": {"family": "beta", "alpha": inc["z"].params[0].tolist(),
                                              "beta": inc["z"].params[1].tolist()}}}
        version = op.info(refresh=True)["version"]
        url = f"{live.url}/v1/operators/logistic-x/draws/{{}}/messages"
        for seed in ("-1", "abc", str(2**63), "1.5"):
            r = httpx.post(url.format(seed), json=body)
            assert r.status_code == 422, (seed, r.status_code, r.text)
            assert any(e["loc"][:2] == ["path", "seed"] for e in r.json()["detail"]), r.text
        r = httpx.post(url.format(3), json=body)
        assert r.status_code == 200 and r.json()["draw"] == 3 and r.json()["log_var"] is None
        assert r.json()["mode"] == "predict" and r.json()["uncertain"] is None
        assert httpx.post(url.format(3), json={**body, "to": "z"}).status_code == 422  # (the body as the messages')
        assert httpx.post(f"{live.url}/v1/operators/nope/draws/3/messages", json=body).status_code == 404
        assert op.info(refresh=True)["version"] == version  # (nothing learned)


def test_a_draw_of_an_operator_that_learned_meanwhile_is_refused(live):
    inc = probe("logistic", 5)
    with RemoteOperator(live.url, "logistic-x", mode="predict", token=TOKEN) as op:
        mean, d, e = op.draws(2, random_state=0, mean=True)
        d.belief(inc)
        op.observe(inc, op.belief(inc))  # (a new version)
        with pytest.raises(RemoteOperatorError, match="changed"):
            d.belief(inc)
        with pytest.raises(RemoteOperatorError, match="changed"):  # (one version for every draw of one call)
            e.belief(inc)
        with pytest.raises(RemoteOperatorError, match="changed"):
            mean.belief(inc)
    with pytest.raises(ValueError, match="`n`"):
        RemoteOperator(live.url, "logistic-x", mode="predict").draws(0)
    with pytest.raises(ValueError, match="mode='oracle'"):
        RemoteOperator(live.url, "logistic-x", mode="oracle").draws(1)
