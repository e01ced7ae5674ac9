"""Certificates on every path (issue 20): rule, oracle, learned, jit, remote, and the EP engines'
counts.  Each field is checked against an independent computation: propriety against the outgoing
message built by division, ESS against the sampler's own estimate, Monte Carlo standard errors
against the actual error w.r.t. quadrature, log variances against ``predict``."""

from __future__ import annotations

import numpy as np
import pytest

from kjit.certificates import Certificates, certified, outgoing_proper
from kjit.ep import BayesianLogisticRegression
from kjit.ep.graph import FactorGraph, GraphEP
from kjit.factors import get_factor
from kjit.factors.logistic import LogisticOperator
from kjit.families import Gaussian
from kjit.operators import JITOperator, KernelOperator
from kjit.oracles import ImportanceSamplingOracle, MessageImportanceSampler, QuadratureOracle
from kjit.training import make_training_set

from test_service_fixtures import (  # noqa: F401 - fixtures
    TOKEN,
    app_client,
    live,
    load_pristine,
    pristine_store,
    probe,
    settings_for,
    store_dir,
)

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")

F = get_factor("logistic")


def _inc(n=60, seed=0):
    return F.default_incoming(n, np.random.default_rng(seed))


def _proper(q, m):
    return np.asarray((q / m).is_proper, bool).ravel()


@pytest.fixture(scope="module")
def kernel_op():
    ts = make_training_set(F, "x", F.default_incoming, QuadratureOracle(F), n=300, random_state=1)
    return KernelOperator(F, "x", n_inner=40, n_outer=80, random_state=0).fit(ts)


def test_rule_certificates():
    inc = _inc()
    q, c = certified(QuadratureOracle(F), inc, "x")
    assert len(c) == 60 and set(c.source) == {"rule"}
    assert np.isnan(c.ess).all() and np.isnan(c.mc_se).all() and np.isnan(c.log_var).all()
    assert c.projection == "kl" and c.version is None and c.threshold is None
    np.testing.assert_array_equal(c.proper, _proper(q, inc["x"]))
    # a hand-crafted operator without certificates of its own: rule, propriety computed
    q2, c2 = certified(LogisticOperator(), inc, "x")
    assert set(c2.source) == {"rule"} and c2.of is q2
    np.testing.assert_array_equal(c2.proper, _proper(q2, inc["x"]))
    # the projection convention is the factor's
    g = get_factor("gamma_rate", projection="moments")
    inc_g = g.default_incoming(5, np.random.default_rng(1))
    _, cg = certified(QuadratureOracle(g), inc_g, g.variables[0])
    assert cg.projection == "moments"


def test_oracle_certificates_ess_and_se_are_the_samplers():
    inc = _inc(200, seed=3)
    mis = MessageImportanceSampler(F, random_state=5, target_se=0.02)
    q, c = mis.certified(inc, "x")
    assert set(c.source) == {"oracle"} and c.of is q and mis.last_certificates_ is c
    # the ESS is the sampler's own: the same seed's estimate gives the same numbers
    _, ess, se, _, _ = MessageImportanceSampler(F, random_state=5, target_se=0.02).estimate(inc, "x")
    np.testing.assert_array_equal(c.ess, ess)
    np.testing.assert_array_equal(c.mc_se, se)
    # the standard errors describe the actual error: z-scores against quadrature (mean coordinate
    # in units of the belief's sd, log variance) — |z| < 3 for ~99.7 % under normality; allow 95 %
    exact = QuadratureOracle(F).belief(inc, "x")
    z_mean = (q.mean() - exact.mean()) / np.sqrt(exact.var()) / c.mc_se[:, 0]
    z_lv = (np.log(q.var()) - np.log(exact.var())) / c.mc_se[:, 1]
    assert np.mean(np.abs(z_mean) < 3) > 0.95 and np.mean(np.abs(z_lv) < 3) > 0.95
    np.testing.assert_array_equal(c.proper, _proper(q, inc["x"]))
    # the shared-proposal sampler reports its ESS (no standard errors)
    iso = ImportanceSamplingOracle(F, n_samples=20_000, random_state=0, min_ess=5)
    q3, c3 = certified(iso, _inc(8), "x")
    assert set(c3.source) == {"oracle"} and np.all(c3.ess >= 5) and np.isnan(c3.mc_se).all()
    np.testing.assert_array_equal(c3.ess, iso.last_ess_)


def test_learned_certificates(kernel_op):
    inc = _inc()
    q, lv = kernel_op.predict(inc)
    c = kernel_op.last_certificates_
    assert c.of is q and set(c.source) == {"learned"}
    np.testing.assert_array_equal(c.log_var, lv)
    assert c.version == kernel_op.n_train_ == 300 and c.threshold is None
    np.testing.assert_array_equal(c.proper, _proper(q, inc["x"]))
    assert c.counts()["learned_unrated"] == 60  # no threshold: quality unrated
    q2, c2 = kernel_op.certified(inc)
    assert q2 == q and c2.of is q2
    # belief: no variance computed, still certified
    q3 = kernel_op.belief(inc)
    assert kernel_op.last_certificates_.of is q3 and np.isnan(kernel_op.last_certificates_.log_var).all()


def test_jit_certificates(kernel_op):
    import copy

    inc = _inc(80, seed=11)
    _, lv = kernel_op.predict(inc)
    thr = float(np.median(lv.max(axis=1)))
    jit = JITOperator(copy.deepcopy(kernel_op), MessageImportanceSampler(F, random_state=0), threshold=thr,
                      selection="all")
    q, lv2, consulted = jit.predict(inc)
    c = jit.last_certificates_
    assert c.of is q and consulted.any() and (~consulted).any()
    np.testing.assert_array_equal(c.source == "oracle", consulted)
    assert np.all(c.ess[consulted] > 0) and np.isnan(c.ess[~consulted]).all()
    assert np.all(np.isfinite(c.mc_se[consulted])) and np.isnan(c.mc_se[~consulted]).all()
    assert c.threshold == thr and c.version == 300 + int(consulted.sum())
    np.testing.assert_array_equal(c.log_var, lv2)
    # every learned answer is within the threshold (the rest were consulted)
    assert c.counts()["learned_confident"] == int((~consulted).sum())
    np.testing.assert_array_equal(c.proper, _proper(q, inc["x"]))
    # a quadrature oracle: consulted rows are "rule"
    jit_q = JITOperator(copy.deepcopy(kernel_op), QuadratureOracle(F), threshold=thr, selection="all")
    q4, c4 = jit_q.certified(inc)
    assert set(c4.source) == {"rule", "learned"} and (c4.source == "rule").sum() == consulted.sum()
    # initial phase: every row is the oracle's, no variance
    jit0 = JITOperator(None, QuadratureOracle(F), to="x", initial_batch=500)
    q5, c5 = jit0.certified(inc)
    assert set(c5.source) == {"rule"} and np.isnan(c5.log_var).all()


def test_certificates_json_round_trip(kernel_op):
    inc = _inc(10)
    jit = JITOperator(kernel_op, MessageImportanceSampler(F, random_state=0), threshold=-100.0)
    import copy

    jit.operator = copy.deepcopy(kernel_op)
    jit.predict({v: m[:5] for v, m in inc.items()})
    c = jit.last_certificates_
    back = Certificates.from_json(c.to_json())
    for name in ("source", "proper"):
        np.testing.assert_array_equal(getattr(back, name), getattr(c, name))
    for name in ("log_var", "ess", "mc_se"):
        np.testing.assert_array_equal(getattr(back, name), getattr(c, name))
    assert (back.threshold, back.version, back.projection) == (c.threshold, c.version, c.projection)
    with pytest.raises(ValueError, match="source"):
        Certificates(["made-up"], ("a",))


def test_linear_ep_counts_answers_by_source(kernel_op):
    import copy

    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 2))
    y = (X @ np.array([1.0, -1.0]) + 0.3 * rng.normal(size=40) > 0).astype(float)
    # rule
    res = BayesianLogisticRegression(QuadratureOracle(F), max_iter=5).fit(X, y).result_
    a = res.answers
    assert a["rule"] > 0 and a["learned"] == a["oracle"] == 0
    assert a["rule"] == sum(r.answers.get("rule", 0) for r in res.history)
    # learned, with some uncertain answers replaced by the oracle
    _, lv = kernel_op.predict(_inc(200, seed=2))
    jit = JITOperator(copy.deepcopy(kernel_op), QuadratureOracle(F), threshold=float(np.median(lv.max(axis=1))))
    res2 = BayesianLogisticRegression(jit, max_iter=5).fit(X, y).result_
    a2 = res2.answers
    assert a2["learned"] > 0 and a2["learned"] == a2["learned_confident"] + a2["learned_uncertain"] \
        + a2["learned_unrated"]
    assert a2["rule"] == sum(int(r.answers.get("rule", 0)) for r in res2.history)
    assert res2.summary()["answers"] == a2


def test_graph_ep_counts_answers():
    g = FactorGraph()
    g.add_variable("x", Gaussian(0.0, 4.0))
    for zv in (0.9, 0.2, 0.7):
        from kjit.families import Beta

        g.add_factor("logistic", {"x": "x", "z": Beta(1 + 5 * zv, 1 + 5 * (1 - zv))})
    res = GraphEP(g, max_iter=5).run()
    a = res.answers
    assert a["rule"] > 0 and a["learned"] == 0 and a["oracle"] == 0
    assert a["rule"] == sum(r.answers.get("rule", 0) for r in res.history)


# ------------------------------------------------------------------------------ the service and the client
def _body(inc):
    return {"to": "x", "incoming": {v: {"family": type(m).__name__.lower(),
                                        **{p: np.asarray(a, float).tolist() for p, a in zip(m.param_names, m.params)}}
                                    for v, m in inc.items()}}


def test_service_certificates_in_every_mode(app_client, pristine_store):
    local = load_pristine(pristine_store, "logistic-x")
    inc = probe("logistic", 30)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc))
    assert r.status_code == 200, r.text
    c = r.json()["certificates"]
    assert c["source"] == ["learned"] * 30 and c["version"] == r.json()["version"] == 0
    assert c["threshold"] == local.threshold and c["log_var"] == r.json()["log_var"]
    assert c["proper"] == r.json()["messages"]["is_proper"] and c["ess"] is None
    q_loc, lv_loc = local.operator.predict(inc)
    conf = np.all(lv_loc <= local.threshold, axis=1)
    back = Certificates.from_json(c)
    np.testing.assert_array_equal(back.confident, conf)
    r = app_client.post("/v1/operators/logistic-x/messages?mode=oracle", json=_body(inc), headers=auth)
    c = r.json()["certificates"]
    assert c["source"] == ["rule"] * 30 and c["log_var"] is None  # the quadrature oracle: an exact rule
    r = app_client.post("/v1/operators/logistic-x/messages?mode=jit", json=_body(inc), headers=auth)
    body = r.json()
    c = body["certificates"]
    cons = np.array(body["consulted"])
    assert cons.any() and (~cons).any()
    np.testing.assert_array_equal(np.array(c["source"]) == "rule", cons)
    assert c["version"] == body["version"] == 1


def test_remote_operator_keeps_certificates(live, pristine_store):
    from kjit.client import RemoteOperator

    inc = probe("logistic", 25)
    with RemoteOperator(live.url, "logistic-x", mode="predict") as op:
        q = op.belief(inc, "x")
        assert isinstance(q, Gaussian)  # unchanged for existing callers
        c = op.last_certificates
        assert c is op.last_certificates_ and c.of is q and set(c.source) == {"learned"}
        np.testing.assert_array_equal(c.proper, _proper(q, inc["x"]))
        q2, c2 = certified(op, inc, "x")
        assert q2 == q and len(c2) == 25
        q3, lv, cons = op.predict(inc)
        np.testing.assert_array_equal(op.last_certificates.log_var, lv)
    with RemoteOperator(live.url, "logistic-x", mode="jit", token=TOKEN) as op:
        q, lv, cons = op.predict(inc)
        c = op.last_certificates
        np.testing.assert_array_equal(c.source == "rule", cons)
        assert c.version == op.last_version_
    # a local oracle (client-side JIT loop): the rows answered here carry its certificates
    with RemoteOperator(live.url, "logistic-x", mode="predict", token=TOKEN,
                        oracle=MessageImportanceSampler(F, random_state=0)) as op:
        q, lv, cons = op.predict(inc)
        c = op.last_certificates
        assert cons.any()
        np.testing.assert_array_equal(c.source == "oracle", cons)
        assert np.all(c.ess[cons] > 0)


def test_service_certificate_threshold_is_the_answers(app_client, pristine_store, monkeypatch):
    """The certificates' threshold is the one in force when the answer was computed: a threshold
    change the audit worker commits right after the request released the operator's lock must not
    relabel the answer (its `confident` rows are those the operator answered under its threshold)."""
    from service.store import Entry

    entry = app_client.app.state.store.get("logistic-x")
    before = float(entry.jit.threshold)
    def then_audit_lowers_threshold(original):
        def wrapped(self, *args, **kw):
            out = original(self, *args, **kw)
            self.jit.threshold = before - 5.0  # the audit's record, applied between the lock and the response
            return out
        return wrapped

    # mode=predict is answered by Entry._screen, mode=jit by Entry._predict
    monkeypatch.setattr(Entry, "_screen", then_audit_lowers_threshold(Entry._screen))
    monkeypatch.setattr(Entry, "_predict", then_audit_lowers_threshold(Entry._predict))
    try:
        inc = probe("logistic", 20)
        for mode in ("predict", "jit"):
            cert = entry.predict_certified(inc, mode)[5]
            assert cert.threshold == before, mode
            entry.jit.threshold = before
    finally:
        entry.jit.threshold = before


def test_uniform_is_the_general_constructor():
    """``uniform`` (which skips the per-row check of the sources) builds what ``Certificates``
    builds from the same rows; an unknown source or keyword is refused."""
    q = Gaussian(np.array([0.3, -1.0, 2.0]), np.array([1.2, 0.5, 3.0]))
    m = Gaussian(np.array([0.1, 0.0, 2.0]), np.array([2.2, 0.4, 3.0]))
    lv = np.array([[-3.0, -4.0], [np.nan, 1.0], [-9.0, -8.0]])
    for src in ("learned", "oracle", "rule"):
        for kw in ({}, {"log_var": lv, "threshold": -3.5, "version": 7}, {"ess": [5.0, 6.0, 7.0], "threshold": np.inf}):
            u = Certificates.uniform(src, q, m, projection="moments", **kw)
            g = Certificates(np.full(3, src, dtype=object), Gaussian.coord_names, projection="moments",
                             proper=outgoing_proper(q, m), **kw)
            for name in Certificates.__slots__:
                a, b = getattr(u, name), getattr(g, name)
                if isinstance(a, np.ndarray):
                    assert a.dtype == b.dtype
                    np.testing.assert_array_equal(a, b)
                else:
                    assert a == b, name
    assert Certificates.uniform("learned", q, m).proper.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="source"):
        Certificates.uniform("guess", q, m)
    with pytest.raises(TypeError, match="proper"):
        Certificates.uniform("learned", q, m, proper=[True] * 3)


def test_json_columns_of_one_row_are_the_arrays_columns():
    """json_columns of ten one-number float columns (a one-message response; by Python floats)
    equals its answer for the same numbers as one (10, 1) array (the array path), specials
    included; columns of another dtype or length take the array path (ints come out as floats)."""
    from kjit.certificates import json_columns

    vals = [0.0, -0.0, 5e-324, -1e308, np.inf, -np.inf, np.nan, 1.5, -2.25, 1e-300]
    cols = [np.array([v]) for v in vals]
    got = json_columns(cols)
    want = json_columns(np.array(vals)[:, None])
    assert got == want and [type(c[0]) for c in got] == [type(c[0]) for c in want]
    assert [str(c[0]) for c in got] == ["0.0", "-0.0", "5e-324", "-1e+308", "None", "None", "None", "1.5", "-2.25",
                                        "1e-300"]
    assert json_columns([np.array([3]), np.array([True])]) == [[3.0], [1.0]]
    assert json_columns([np.array([1.0, np.nan])]) == [[1.0, None]]


# ------------------------------------------------------------------------------ found by an audit (session 21)
def _far(n, seed, lo=4.0, hi=9.0):
    rng = np.random.default_rng(seed)
    mean = rng.choice([-1.0, 1.0], n) * rng.uniform(lo, hi, n)
    var = np.exp(rng.uniform(np.log(0.1), np.log(3.0), n))
    label = rng.random(n) < 0.5
    from kjit.families import Beta
    return {"x": Gaussian(mean, var), "z": Beta(np.where(label, 2.0, 1.0), np.where(label, 1.0, 2.0))}


def test_rows_the_jit_rule_would_consult_are_never_certified_confident(kernel_op):
    """screen_certified (the service's mode=predict) rated its certificates on the threshold alone:
    rows below the density guard — which predict consults — were certified confident (KL up to 0.05
    against the exact answer).  They are flagged now: uncertain in the certificates, in their JSON,
    and to the EP engine, which sends them to its oracle with on_uncertain="oracle"."""
    import copy

    inc = {v: type(m).concatenate([m, _far(20, 12)[v]]) for v, m in _inc(60, 11).items()}
    guard = float(np.quantile(kernel_op.density(inc), 0.3))
    jit = JITOperator(copy.deepcopy(kernel_op), QuadratureOracle(F), threshold=0.0, selection="all",
                      density_guard=guard)
    q, cert, unc = jit.screen_certified(inc)
    by_variance = ~np.all(cert.log_var <= cert.threshold, axis=1)
    assert (unc & ~by_variance).sum() >= 5  # rows the guard alone flags
    np.testing.assert_array_equal(cert.uncertain, unc)
    np.testing.assert_array_equal(cert.flagged, unc & ~by_variance)
    assert not (cert.confident & unc).any()
    assert cert.counts()["learned_uncertain"] == unc.sum()
    # what predict does with the same rows: consults exactly those
    _, _, consulted = copy.deepcopy(jit).predict(inc)
    np.testing.assert_array_equal(consulted, unc)
    back = Certificates.from_json(cert.to_json())
    np.testing.assert_array_equal(back.flagged, cert.flagged)
    np.testing.assert_array_equal(back.confident, cert.confident)
    # no flagged row: the key is null, and such JSON (an older server's, too) reads as none flagged
    plain = cert.take(np.flatnonzero(~cert.flagged))
    assert plain.to_json()["flagged"] is None and not Certificates.from_json(plain.to_json()).flagged.any()
    for part in (cert.take([0, 1]), Certificates.concatenate([cert, cert]), cert.replace([0], cert.take([0]))):
        assert part.flagged.dtype == bool


def test_a_message_broadcast_over_the_batch_is_checked_for_propriety():
    """certified() of an operator without certificates of its own, with incoming[to] one message for
    a batch (shape () against q's (6,)): every outgoing message was certified proper — three are not."""
    from kjit.families import Beta

    inc = {"x": Gaussian(0.5, 2.0), "z": Beta(np.array([0.3, 0.5, 2.0, 1.0, 0.4, 3.0]),
                                               np.array([0.3, 0.6, 1.0, 2.0, 0.4, 3.0]))}
    q, cert = certified(LogisticOperator(), inc, "x")
    truth = np.asarray((q / inc["x"]).is_proper, bool)
    assert q.shape == (6,) and not truth.all() and truth.any()
    np.testing.assert_array_equal(cert.proper, truth)
    np.testing.assert_array_equal(outgoing_proper(q, inc["x"]), truth)


def test_an_oracle_without_certificates_is_not_called_an_exact_rule(kernel_op):
    """A user's oracle object (factor + belief, here backed by importance sampling) gave the JIT's
    consulted rows source "rule" — an exact rule's; the client already called such answers "oracle"."""
    import copy

    class MyOracle:
        def __init__(self):
            self.factor = F
            self.inner = ImportanceSamplingOracle(F, n_samples=20_000, random_state=0)

        def belief(self, incoming, to):
            return self.inner.belief(incoming, to)

    jit = JITOperator(copy.deepcopy(kernel_op), MyOracle(), threshold=-30.0)  # every row consulted
    _, cert = jit.certified(_inc(4, 3))
    assert list(cert.source) == ["oracle"] * 4
    # an object that says what it is keeps its word
    MyOracle.certificate_source = "rule"
    _, cert = JITOperator(copy.deepcopy(kernel_op), MyOracle(), threshold=-30.0).certified(_inc(4, 3))
    assert list(cert.source) == ["rule"] * 4


def test_an_oracle_error_of_a_sub_batch_names_the_batchs_rows():
    """rows_of_batch renamed .rows but the message still numbered the sub-batch's rows ("rows [3]"
    for row 4 of the request)."""
    from kjit.errors import OracleError, rows_of_batch

    exc = rows_of_batch(OracleError("the tilted moments of rows [1] are not a distribution", rows=[1]), [2, 4, 7])
    assert exc.rows.tolist() == [4] and "of the whole batch: rows [4]" in str(exc)
    same = rows_of_batch(OracleError("rows [1] failed", rows=[1]), [0, 1, 2])
    assert str(same) == "rows [1] failed"  # (nothing to say where the numbers agree)


def test_the_ep_engine_sends_flagged_answers_to_its_oracle(kernel_op):
    """A served operator in mode=predict marks the rows its just-in-time rule would consult (here:
    below its density guard) in its certificates; the EP engine with on_uncertain="oracle" re-asked
    only the rows above the threshold and used the flagged ones as they were."""
    import copy

    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 2)) * 3.0
    y = (X @ np.array([1.0, -1.0]) > 0).astype(float)
    guard = float(np.quantile(kernel_op.density(_inc(200, seed=5)), 0.5))
    jit = JITOperator(copy.deepcopy(kernel_op), QuadratureOracle(F), threshold=50.0, selection="all",
                      density_guard=guard)

    class Screened:  # what a RemoteOperator in mode=predict gives the engine
        factor, to, threshold = F, "x", 50.0

        def predict(self, incoming, to=None):
            q, cert, _ = jit.screen_certified(incoming, to)
            self.last_certificates_ = cert
            n = len(cert)
            return q, cert.log_var, np.zeros(n, dtype=bool)

        def belief(self, incoming, to=None):
            return self.predict(incoming, to)[0]

    seen = []
    real = jit.screen_certified

    def spy(*a, **k):
        out = real(*a, **k)
        # the rows the rule consults whose variance is below the threshold: the guard's
        seen.append(int((np.asarray(out[2]).ravel() & np.all(out[1].log_var <= 50.0, axis=1)).sum()))
        return out

    jit.screen_certified = spy
    res = BayesianLogisticRegression(Screened(), oracle=QuadratureOracle(F), on_uncertain="oracle",
                                     max_iter=3).fit(X, y).result_
    assert sum(seen) > 0  # the threshold (50) flags nothing: the guard alone does
    assert sum(r.n_oracle for r in res.history) == sum(seen) and res.n_uncertain == 0
