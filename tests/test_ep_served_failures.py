"""EP through a served operator must converge and never fail silently (found by an adversarial review
of EP with RemoteOperator, session 18): a wrong operator name or recipient raises at once; an operator
that fails every update stops the run with a warning instead of returning the prior quietly; a 422
naming rows skips just those rows; a server whose batch limit shrank is followed; a lowered threshold
is what the client reports next."""

from __future__ import annotations

import numpy as np
import pytest

from kjit.client import RemoteOperator, UnknownOperatorError
from kjit.ep import LinearEP
from kjit.errors import ConfigurationError
from kjit.factors import Logistic
from kjit.families import Beta
from kjit.oracles import QuadratureOracle
from test_service_fixtures import (  # noqa: F401 - fixtures
    TOKEN,
    live,
    pristine_store,
    probe,
    settings_for,
    store_dir,
)

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")


def _problem(n=30, d=3, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    X = np.hstack([rng.normal(size=(n, d - 1)) * scale, np.ones((n, 1))])
    y = (X @ rng.normal(size=d) + 0.3 * rng.normal(size=n) > 0).astype(float)
    return X, {"z": Beta(np.where(y > 0, 2.0, 1.0), np.where(y > 0, 1.0, 2.0))}  # the label messages


class _Failing:
    """An operator that raises on every call (an unreachable server)."""

    factor = Logistic()
    to = "x"

    def __init__(self):
        self.calls = 0

    def belief(self, incoming, to=None):
        self.calls += 1
        raise RuntimeError("no answer from the server (ConnectError)")


def test_an_operator_that_fails_every_update_stops_the_run_with_a_warning():
    from kjit.ep.engine import OPERATOR_FAILURE_ITERATIONS

    X, obs = _problem()
    op = _Failing()
    with pytest.warns(RuntimeWarning, match="failed every update"):
        r = LinearEP(op, site_var="x", max_iter=50).run(X, obs)
    assert r.outcome == "operator_failed" and not r.converged
    assert r.iterations == OPERATOR_FAILURE_ITERATIONS and "ConnectError" in r.status


def test_a_configuration_error_is_raised_at_once():
    class _WrongTo(_Failing):
        def belief(self, incoming, to=None):
            self.calls += 1
            raise ConfigurationError("this operator sends messages to 'z', not `to`='x'")

    X, obs = _problem()
    op = _WrongTo()
    with pytest.raises(ConfigurationError):
        LinearEP(op, site_var="x", max_iter=50).run(X, obs)
    assert op.calls == 1


def test_a_served_operator_misnamed_or_asked_for_the_wrong_recipient_raises(live):
    X, obs = _problem()
    with RemoteOperator(live.url, "logistic_x", mode="predict") as op:  # the name is logistic-x
        with pytest.raises(UnknownOperatorError, match="unknown operator"):
            LinearEP(op, site_var="x").run(X, obs)
    with RemoteOperator(live.url, "logistic-x", mode="predict") as op:
        with pytest.raises(ConfigurationError, match="sends messages to 'x'"):
            op.belief(probe("logistic", 3), to="z")


def test_a_422_naming_a_row_skips_that_row_only(live):
    """A cavity beyond what JSON requests may carry (variance > 1e100) is refused by row; the other
    rows are answered, and EP's posterior is that of exact EP on the other rows (row 3's site stays
    at its start, 0; before: the whole batch was skipped every iteration and the posterior stayed at
    the prior).  The run says it did not converge: an update is skipped every iteration."""
    X, obs = _problem(n=30)
    X[3, 0] = 1e60  # row 3's cavity variance ~1e120
    with RemoteOperator(live.url, "logistic-x", mode="oracle", token=TOKEN) as op:
        r = LinearEP(op, site_var="x", max_iter=30).run(X, obs)
    assert r.history[0].skipped["operator_error"] == 1 and r.history[0].n_updated == 29
    assert r.outcome == "max_iter" and "skipped" in r.status
    keep = np.arange(30) != 3
    ref = LinearEP(QuadratureOracle(Logistic()), site_var="x", max_iter=30).run(
        X[keep], {"z": obs["z"][keep]})
    assert ref.converged
    np.testing.assert_allclose(r.posterior.mean, ref.posterior.mean, atol=1e-6)
    np.testing.assert_allclose(r.posterior.cov, ref.posterior.cov, atol=1e-6)


def test_the_client_follows_a_smaller_batch_limit_and_a_lowered_threshold(store_dir):
    from service.testing import ThreadedServer

    inc = probe("logistic", 40)
    with ThreadedServer(settings_for(store_dir, max_batch=16)) as srv, \
            RemoteOperator(srv.url, "logistic-x", mode="predict") as op:
        entry = srv.app.state.store.entries["logistic-x"]
        info = op.info()
        assert op.max_batch == 16
        q0 = op.belief(inc)  # (split in three requests)
        # limits learned before the server restarted with a smaller KJIT_MAX_BATCH: stale
        op._info = {**info, "limits": {**info["limits"], "max_batch": 500}}
        q1 = op.belief(inc)
        assert op.max_batch == 16 and q1 == q0
        # the audit lowered the threshold: reported from the next answer on
        thr0 = op.threshold
        entry.jit.threshold = thr0 - 2.0
        op.belief({v: m[:2] for v, m in inc.items()})
        assert op.threshold == pytest.approx(thr0 - 2.0)


def test_an_oracle_failure_on_one_row_is_named_by_the_jit_and_the_server(live):
    """The exact rule refuses one row (beyond its numerical reach): the JIT names the request's row
    (it named the consulted sub-batch's), the server's 422 names it (``["body", "incoming", i]``), the
    client passes it on, and EP skips that row only (a second review: the whole batch was skipped and
    the new early stop then ended the run at the prior)."""
    import copy

    from kjit.errors import OracleError
    from kjit.families import Gaussian
    from kjit.operators import JITOperator

    inc = probe("logistic", 10)
    inc["x"] = Gaussian(np.where(np.arange(10) == 7, 1e50, inc["x"].mean()), inc["x"].var())
    jit = live.app.state.store.entries["logistic-x"].jit
    local = JITOperator(copy.deepcopy(jit.operator), QuadratureOracle(Logistic()), threshold=-1e9)  # consult all
    with pytest.raises(OracleError) as err:
        local.predict(inc)
    np.testing.assert_array_equal(err.value.rows, [7])
    X, obs = _problem(n=30)
    obs["z"] = Beta(np.where(np.arange(30) == 3, 1.0, obs["z"].alpha), np.where(np.arange(30) == 3, 1e90, obs["z"].beta))
    with RemoteOperator(live.url, "logistic-x", mode="oracle", token=TOKEN) as op:
        r = LinearEP(op, site_var="x", max_iter=30).run(X, obs)
    assert r.outcome == "max_iter" and all(h.skipped["operator_error"] == 1 for h in r.history)
    keep = np.arange(30) != 3
    ref = LinearEP(QuadratureOracle(Logistic()), site_var="x", max_iter=30).run(X[keep], {"z": obs["z"][keep]})
    np.testing.assert_allclose(r.posterior.mean, ref.posterior.mean, atol=1e-6)
