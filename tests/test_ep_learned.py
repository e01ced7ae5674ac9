"""EP with learned operators converges and never fails silently (issue 19).

The minimal cases of the issue, each small and exact:
* a belief a hair wider than the cavity where the factor is log-concave (the message precision
  must be >= 0: Brascamp–Lieb) — learned and sampled answers are put on the right side;
* messages whose precision is within the answer's own error of 0 are used with precision 0, not
  skipped as "negative" every iteration;
* the divergence guard: no engine hands back a non-finite posterior;
* a point-mass cavity is answered by the exact limit, and an oracle failure names its rows;
* uncertain answers are counted and handled by ``on_uncertain``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import special

from kjit.ep import BayesianLogisticRegression, EPConvergenceWarning, LinearEP
from kjit.ep.engine import UncertainAnswerError, UncertainAnswerWarning, _posterior_from_sites
from kjit.factors import Logistic, ProbitNoise
from kjit.families import Bernoulli, Beta, Gaussian
from kjit.operators import KernelOperator, JITOperator, respect_factor_bounds, sign_undetermined
from kjit.factors.logistic import logistic_laplace_limit
from kjit.oracles import OracleError, QuadratureOracle
from kjit.training import logistic_incoming, make_training_set

from test_ep_helpers import logistic_problem


def _labels(y):
    return {"z": Beta(np.where(y == 1, 2.0, 1.0), np.where(y == 1, 1.0, 2.0))}


@pytest.fixture(scope="module")
def small_op():
    """A deliberately small logistic→x operator (200 pairs, D 30/60, the paper's width rule and
    frame — relative to the incoming message): answers of modest accuracy (with the total-variance
    rule in the search, or relative to the factor's near-exact quadrature reference, it is
    accurate enough that no answer is negative even without the factor's bound)."""
    f = Logistic()
    pairs = make_training_set(f, "x", logistic_incoming, QuadratureOracle(f), n=200, random_state=0)
    return KernelOperator(f, "x", n_inner=30, n_outer=60, width_rules="mean_variance", reference="incoming",
                          random_state=0).fit(pairs)


# ----------------------------------------------------------------------------- factor bounds
def test_log_concavity_of_the_builtin_factors():
    z = Beta(np.array([2.0, 1.0, 0.5, 1.0, 3.0]), np.array([1.0, 2.0, 2.0, 0.9, 1.0]))
    inc = {"x": Gaussian(np.zeros(5), np.ones(5)), "z": z}
    np.testing.assert_array_equal(Logistic().log_concave("x", inc), [True, True, False, False, True])
    assert Logistic().log_concave("z", inc) is None
    assert ProbitNoise(0.0).log_concave("f", {"f": Gaussian(np.zeros(3), 1.0), "y": Bernoulli(np.array([0.0, 1.0, 1.0]))}).all()
    assert ProbitNoise(0.1).log_concave("f", {"f": Gaussian(np.zeros(3), 1.0)}) is None


def test_exact_beliefs_obey_the_log_concavity_bound():
    """The bound the operators enforce is a property of the exact answer (independent check: the
    quadrature oracle over a spread of cavities, labels with α, β ≥ 1)."""
    rng = np.random.default_rng(3)
    n = 400
    inc = {"x": Gaussian(rng.uniform(-15, 15, n), np.exp(rng.uniform(-6, 4, n))),
           "z": Beta(rng.uniform(1, 5, n), rng.uniform(1, 5, n))}
    q = QuadratureOracle(Logistic()).belief(inc, "x")
    # relative accuracy 1e-8 of the oracle: never wider than that
    assert np.all(q.var() <= inc["x"].var() * (1 + 1e-8))


def test_respect_factor_bounds_clips_exactly_and_leaves_other_rows_bit_for_bit():
    cav = Gaussian(np.array([9.0, 9.0, 0.0, 1.0]), np.array([1.0, 1.0, 2.0, 0.5]))
    z = Beta(np.array([2.0, 0.5, 2.0, 1.0]), np.array([1.0, 0.5, 1.0, 2.0]))
    q = Gaussian(np.array([9.0002, 9.0, 0.3, 0.9]), np.array([1.000768, 1.2, 1.5, 0.6]))
    out, clipped = respect_factor_bounds(Logistic(), "x", {"x": cav, "z": z}, q)
    np.testing.assert_array_equal(clipped, [True, False, False, True])
    # clipped rows: the cavity's variance exactly, so the message precision is exactly 0
    assert out.var()[0] == 1.0 and out.var()[3] == 0.5
    msg = out / cav
    assert msg.natural()[0, 1] == 0.0 and msg.natural()[3, 1] == 0.0
    np.testing.assert_array_equal(out.mean(), q.mean())      # the shift is kept
    assert out.var()[1] == 1.2 and out.var()[2] == 1.5      # not log-concave / already narrower


def test_learned_operator_answers_the_minimal_case_with_a_proper_message(small_op):
    """Issue 19: incoming N(9, 1) and Beta(2, 1) was served with belief variance 1.000768 (exact
    0.999797): a negative message precision at a confident log variance.  With the factor's
    bound, a learned answer is never wider than the cavity where the factor is log-concave."""
    rng = np.random.default_rng(1)
    n = 2000
    side = rng.choice([-1.0, 1.0], n)
    inc = {"x": Gaussian(side * rng.uniform(2, 20, n), np.exp(rng.uniform(-3, 2, n))),
           "z": Beta(np.where(side > 0, 2.0, 1.0), np.where(side > 0, 1.0, 2.0))}
    q, logvar = small_op.predict(inc)
    assert np.all(q.var() <= inc["x"].var())
    assert np.all((q / inc["x"]).natural()[:, 1] <= 0.0)  # -precision/2 <= 0: precision >= 0
    coords = small_op.predict_coords(inc, return_var=False)
    assert np.all(coords[:, 1] <= np.log(inc["x"].var()))
    one = {"x": Gaussian(9.0, 1.0), "z": Beta(2.0, 1.0)}
    assert small_op.belief(one).var() <= 1.0


def test_bounds_change_nothing_where_the_factor_is_not_log_concave(small_op):
    inc = {"x": Gaussian(np.linspace(-3, 3, 50), 0.7), "z": Beta(0.6, 0.8)}
    coords, var = small_op.predict_coords(inc)
    q = small_op.belief(inc)
    np.testing.assert_allclose(np.log(q.var()), coords[:, 1], rtol=0, atol=1e-15)


def test_sign_undetermined_flags_improper_within_error_only_without_a_guarantee():
    f = Logistic()
    cav = Gaussian(np.zeros(4), np.ones(4))
    inc_nc = {"x": cav, "z": Beta(0.5, 0.5).broadcast_to((4,))}
    coords = np.array([[0.0, 1e-4], [0.0, -1e-4], [0.0, 0.1], [0.0, 1e-4]])
    var = np.array([[1e-6, 1e-6], [1e-6, 1e-6], [1e-6, 1e-6], [1e-12, 1e-12]])
    # sd 1e-3: |δ| = 1e-4 undetermined (either sign); δ = 0.1 determined; sd 1e-6: determined
    np.testing.assert_array_equal(sign_undetermined(f, "x", inc_nc, coords, var), [True, True, False, False])
    inc_lc = {"x": cav, "z": Beta(2.0, 1.0).broadcast_to((4,))}
    assert not sign_undetermined(f, "x", inc_lc, coords, var).any()


def test_jit_consults_where_the_message_sign_is_undetermined(small_op):
    """A row below the variance threshold whose message precision has an undetermined sign (a
    factor with no log-concavity guarantee) goes to the oracle."""
    import copy

    f = Logistic()
    op = copy.deepcopy(small_op)
    inc = {"x": Gaussian(np.array([30.0, 0.0]), np.array([1.0, 1.0])), "z": Beta(np.array([0.7, 2.0]), np.array([0.7, 1.0]))}
    coords, var = op.predict_coords(inc)
    jit = JITOperator(op, QuadratureOracle(f), threshold=float(np.max(np.log(var))) + 1.0)  # nothing above it
    flat = {k: v.ravel() for k, v in inc.items()}
    unc = jit._uncertain(flat, coords, np.log(var))
    epistemic = np.maximum(var - op.noise_var_ * op.y_scale_**2, 0)
    expect = sign_undetermined(f, "x", flat, coords, epistemic)
    assert expect.any()  # the case is exercised (an exact oracle: its noise is below every row's)
    np.testing.assert_array_equal(unc, expect & (epistemic[:, 1] > op.noise_var_ * op.y_scale_[1] ** 2))
    np.testing.assert_array_equal(unc, expect)
    _, _, consulted = jit.predict(inc)
    np.testing.assert_array_equal(consulted, expect)


def test_jit_leaves_an_undetermined_sign_to_the_prediction_once_it_is_surer_than_the_oracle(small_op):
    """The rule on the same rows, with an oracle whose noise (σ_y², the evidence's estimate, in the
    spread coordinate's units σ_y² s²) is above the prediction's epistemic variance: an answer of
    the oracle would be no surer of the sign, so the row is not consulted; below it, it is."""
    import copy

    f = Logistic()
    op = copy.deepcopy(small_op)
    inc = {"x": Gaussian(np.array([30.0, 0.0]), np.array([1.0, 1.0])), "z": Beta(np.array([0.7, 2.0]), np.array([0.7, 1.0]))}
    flat = {k: v.ravel() for k, v in inc.items()}
    coords, var = op.predict_coords(inc)
    epistemic = var - op.noise_var_ * op.y_scale_**2
    jit = JITOperator(op, QuadratureOracle(f), threshold=float(np.max(np.log(epistemic))) + 1.0, uncertainty="epistemic")
    und = sign_undetermined(f, "x", flat, coords, epistemic)
    np.testing.assert_array_equal(und, [True, False])
    for factor, consulted in ((2.0, False), (0.5, True)):
        op.noise_var_ = factor * epistemic[0, 1] / op.y_scale_[1] ** 2
        np.testing.assert_array_equal(jit._uncertain(flat, coords, np.log(epistemic)), [consulted, False])


def test_jit_with_a_sampled_oracle_stops_consulting_a_flat_message():
    """product → x where y's message is centred on 0: x's outgoing message has a precision of ~0,
    whose sign neither the learned operator nor a sampled answer determines.  The JIT used to
    consult such a row on every call forever (each time feeding EP a fresh draw; measured on
    the rank-one model of benchmarks/ep_models.py: 2 rows a sweep for 200 sweeps, no
    convergence); once the operator has learned as much as an oracle answer could tell, it answers.
    (The regression's answer: the reference gate, which answers this row by the product's quadrature
    reference — its check passes, the outgoing precision's sign settled — is off here; with it on, the
    row is never consulted past the initial batch.)"""
    from kjit.factors import get_factor
    from kjit.oracles import MessageImportanceSampler

    f = get_factor("product")
    rng = np.random.default_rng(0)
    n = 300
    xm, ym = rng.normal(0, 1, n), rng.normal(0, 1, n)
    train = {"x": Gaussian(xm, np.exp(rng.uniform(-3, 0, n))), "y": Gaussian(ym, np.exp(rng.uniform(-3, 0, n))),
             "z": Gaussian(xm * ym + rng.normal(0, 0.5, n), np.exp(rng.uniform(-2, 0, n)))}  # where x·y lands
    flat_case = {"x": Gaussian(0.2, 0.05), "y": Gaussian(0.0, 0.02), "z": Gaussian(0.3, 0.25)}
    gated = JITOperator(None, MessageImportanceSampler(f, target_se=0.03, random_state=0), to="x", initial_batch=200,
                        threshold=-8.0, uncertainty="epistemic", operator_kwargs={"random_state": 0})
    gated.predict(train)
    assert gated.operator.gated_rows(flat_case).all()  # (its check passes: answered by the reference)
    assert not any(bool(gated.predict(flat_case)[2]) for _ in range(5))
    jit = JITOperator(None, MessageImportanceSampler(f, target_se=0.03, random_state=0), to="x", initial_batch=200,
                      threshold=-8.0, uncertainty="epistemic",
                      operator_kwargs={"random_state": 0, "reference_gate": None})
    jit.predict(train)
    consulted = [bool(jit.predict(flat_case)[2]) for _ in range(30)]
    assert jit.operator is not None  # past the initial batch: the learned operator decides
    assert sum(consulted[-10:]) == 0, consulted
    # and the case is one the sign rule alone would consult: its sign is undetermined
    flat = {k: v.reshape((1,)) for k, v in flat_case.items()}
    coords, var = jit.operator.predict_coords(flat)
    assert sign_undetermined(f, "x", flat, coords, np.exp(jit._decision_logvar(var)))[0]


# ----------------------------------------------------------------------------- engine
class _FixedOperator:
    """Answers every cavity with a belief of variance cavity·(1 + rel) and a shifted mean; with
    ``logvar`` it reports that log predictive variance (both coordinates)."""

    def __init__(self, rel, shift=0.1, logvar=None, threshold=None):
        self.rel, self.shift, self.logvar = rel, shift, logvar
        if threshold is not None:
            self.threshold = threshold

    def belief(self, incoming, to):
        c = incoming["x"]
        return Gaussian(c.mean() + self.shift * np.sqrt(c.var()), c.var() * (1 + self.rel))

    def predict(self, incoming, to):
        q = self.belief(incoming, to)
        lv = np.full((len(q), 2), np.nan if self.logvar is None else self.logvar)
        return q, lv


def test_messages_within_their_error_of_precision_zero_are_used_as_zero():
    X, y = logistic_problem(30, 3, seed=2)
    lab = _labels(y)
    # an answer a relative 1e-9 wider than the cavity (below the default answer_rtol 1e-8): precision 0
    res = LinearEP(_FixedOperator(1e-9), max_iter=5).run(X, lab)
    assert res.skipped["negative"] == 0 and sum(r.n_zeroed for r in res.history) == 30 * res.iterations
    np.testing.assert_allclose(res.site_precision, 0.0, atol=0)
    # 1e-3 wider with no reported error: a real negative precision, skipped and counted
    res = LinearEP(_FixedOperator(1e-3), max_iter=3).run(X, lab)
    assert res.skipped["negative"] == 30 * 3 and not res.converged
    # 1e-3 wider with a reported sd of log v of 1e-2 (log var -9.2): indistinguishable from 0
    res = LinearEP(_FixedOperator(1e-3, logvar=np.log(1e-4)), max_iter=3).run(X, lab)
    assert res.skipped["negative"] == 0 and sum(r.n_zeroed for r in res.history) == 30 * res.iterations


def test_posterior_from_sites_rejects_an_overflowing_mean():
    A = np.array([[1.0], [1.0]])
    # b = Aᵀh is finite (2e307), the precision too (1e-3): the mean 2e310 is not
    assert _posterior_from_sites(A, np.array([1e-3]), np.array([1e307, 1e307]), np.array([1e-12, 1e-12])) is None


class _ExplodingOperator:
    """Beliefs ever narrower and further out: sites grow without bound (a poor operator)."""

    def belief(self, incoming, to):
        c = incoming["x"]
        return Gaussian(c.mean() + 1e3 * np.sqrt(c.var()) + 1.0, c.var() * 1e-6)


@pytest.mark.parametrize("schedule", ["parallel", "sequential"])
def test_divergence_guard_keeps_the_last_finite_state(schedule):
    X, y = logistic_problem(10, 2, seed=0)
    with pytest.warns(EPConvergenceWarning, match="diverged at iteration"):
        res = LinearEP(_ExplodingOperator(), max_iter=100, schedule=schedule).run(X, _labels(y))
    assert res.outcome == "diverged" and not res.converged
    assert res.status.startswith(f"diverged at iteration {res.diverged_at}")
    assert np.all(np.isfinite(res.mean)) and np.all(np.isfinite(res.cov))
    assert np.all(np.isfinite(res.site_precision)) and np.all(np.isfinite(res.site_shift))
    assert np.all(np.linalg.eigvalsh(res.cov) > 0)
    assert res.summary()["outcome"] == "diverged"


def test_models_report_divergence_instead_of_a_nan_mean():
    X, y = logistic_problem(10, 2, seed=0)
    m = BayesianLogisticRegression(_ExplodingOperator(), max_iter=100).fit(X, y)
    assert m.result_.outcome == "diverged"
    assert np.all(np.isfinite(m.posterior_.mean))
    assert np.isfinite(m.test_error(X, y))


# ----------------------------------------------------------------------------- oracles
def test_point_mass_cavity_is_answered_by_its_exact_limit():
    """Issue 19: Gaussian(-2.66, 3.47e-23) with Beta(2, 1) raised a bare ValueError."""
    o = QuadratureOracle(Logistic())
    q = o.belief({"x": Gaussian(-2.66, 3.47e-23), "z": Beta(2.0, 1.0)}, "x")
    assert q.mean() == pytest.approx(-2.66, abs=1e-20) and q.var() == pytest.approx(3.47e-23, rel=1e-15)
    # the limit agrees with the panel rule where both are accurate (v = 1e-9, 1e-11: the
    # limit's relative error in the variance is O(v) and the rule's is 1e-8 at worst)
    for v in (1e-9, 1e-11):
        mu, a, b = np.array([-2.66, 4.0]), np.array([2.0, 1.0]), np.array([1.0, 5.0])
        qq = o.belief({"x": Gaussian(mu, v), "z": Beta(a, b)}, "x")
        m_l, v_l = logistic_laplace_limit(mu, np.full(2, v), a, b)
        np.testing.assert_allclose(qq.var(), v_l, rtol=1e-8)
        # (the shift, ~1e-9, is a difference of numbers ~2.66 whose ulp is 4.4e-16 — 5e-7 of it: a few ulp)
        np.testing.assert_allclose(qq.mean() - mu, m_l - mu, rtol=1e-6, atol=4 * np.spacing(2.66))
    # the limit's message precision is the factor's curvature −l''(μ) = (α+β−2) σ(μ) σ(−μ)
    v = 1e-10
    m_l, v_l = logistic_laplace_limit(np.array([-2.66]), np.array([v]), np.array([2.0]), np.array([1.0]))
    curv = special.expit(-2.66) * special.expit(2.66)
    # (1/v − 1/v_q at 1e10 carries a round-off of ~1e-6 absolute: 3e-5 of the curvature)
    assert (1 / v_l[0] - 1 / v) == pytest.approx(curv, rel=1e-4)


def test_oracle_failures_name_their_rows():
    o = QuadratureOracle(ProbitNoise(0.0))
    from kjit.families import Bernoulli

    inc = {"f": Gaussian(np.array([0.0, -1e4, 1.0]), np.array([1.0, 1e-6, 1.0])), "y": Bernoulli(np.array([1.0, 1.0, 1.0]))}
    try:
        o.belief(inc, "f")
    except OracleError as exc:  # the far-tail row only, so EP skips it alone
        assert list(exc.rows) == [1]
    else:  # the tail rule handled it: then the answer must be a distribution
        pass


# ----------------------------------------------------------------------------- uncertainty policy
def test_uncertain_answers_are_counted_warned_raised_or_replaced():
    X, y = logistic_problem(20, 2, seed=4)
    lab = _labels(y)
    noisy = _FixedOperator(-0.01, logvar=-5.0, threshold=-8.0)  # every answer above the threshold
    with pytest.warns(UncertainAnswerWarning, match="above the operator's uncertainty threshold"):
        res = LinearEP(noisy, max_iter=3).run(X, lab)
    assert res.n_uncertain == 20 * res.iterations and "above the operator's uncertainty threshold" in res.status
    with pytest.warns(UncertainAnswerWarning) as rec:  # (through a model: still the user's line)
        BayesianLogisticRegression(noisy, max_iter=3, warn_unconverged=False).fit(X, y)
    assert [w.filename for w in rec if issubclass(w.category, UncertainAnswerWarning)] == [__file__]
    with pytest.raises(UncertainAnswerError):
        LinearEP(noisy, max_iter=3, on_uncertain="raise").run(X, lab)
    with pytest.raises(ValueError, match="needs an oracle"):
        LinearEP(noisy, on_uncertain="oracle").run(X, lab)
    # replaced by the oracle: exactly quadrature-EP
    oracle = QuadratureOracle(Logistic())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncertainAnswerWarning)
        res = LinearEP(noisy, on_uncertain="oracle", oracle=oracle, tol=1e-10, max_iter=100).run(X, lab)
    ref = LinearEP(oracle, tol=1e-10, max_iter=100).run(X, lab)
    assert res.n_uncertain == 0 and sum(r.n_oracle for r in res.history) > 0
    np.testing.assert_allclose(res.mean, ref.mean, rtol=1e-12, atol=1e-14)
    # below the threshold: nothing counted
    quiet = _FixedOperator(-0.01, logvar=-12.0, threshold=-8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncertainAnswerWarning)
        assert LinearEP(quiet, max_iter=3).run(X, lab).n_uncertain == 0


@pytest.mark.parametrize("logvar, threshold", [(np.nan, -8.0), (-12.0, np.nan)])
def test_a_nan_variance_or_threshold_is_never_confident(logvar, threshold):
    """A NaN log variance (a server's null) or a NaN threshold compared with ``>`` is False: the
    answers passed as confident and on_uncertain="raise" never fired (found by an audit: EP
    returned a posterior off by every answer's error, with no warning)."""
    X, y = logistic_problem(20, 2, seed=4)
    lab = _labels(y)
    op = _FixedOperator(-0.01, logvar=logvar, threshold=threshold)
    with pytest.raises(UncertainAnswerError):
        LinearEP(op, max_iter=3, on_uncertain="raise").run(X, lab)
    with pytest.warns(UncertainAnswerWarning):
        res = LinearEP(op, max_iter=3).run(X, lab)
    assert res.n_uncertain == 20 * res.iterations


def test_above_threshold_counts_nan_as_uncertain():
    from kjit.certificates import above_threshold

    lv = np.array([[-10.0, -12.0], [-10.0, np.nan], [-7.0, -12.0], [np.nan, np.nan]])
    assert above_threshold(lv, -8.0).tolist() == [False, True, True, True]
    assert above_threshold(lv, np.nan).tolist() == [True] * 4
    assert above_threshold(lv, np.inf).tolist() == [False, True, False, True]


def test_learned_operator_ep_skips_no_message_as_negative(small_op, monkeypatch):
    """The engine-level effect (the issue: 17-18 % of a served operator's messages skipped as
    negative, every iteration): with the factor's bound, none is; without it (the bound
    switched off) the same run skips some — the test can fail.  Convergence with the served
    operator is measured by benchmarks/ep_learned.py (this small operator is too poor to
    converge on a hard problem: KL up to 0.06)."""
    X, y = logistic_problem(60, 3, seed=5, scale=3.0)
    res = LinearEP(small_op, max_iter=30, tol=1e-6).run(X, _labels(y))
    assert res.skipped["negative"] == 0
    monkeypatch.setattr(Logistic, "log_concave", lambda self, to, incoming: None)
    res = LinearEP(small_op, max_iter=30, tol=1e-6).run(X, _labels(y))
    assert res.skipped["negative"] > 0


# ----------------------------------------------------------------------------- random problems
def _random_problem(rng):
    n = int(rng.integers(1, 25))
    d = int(rng.integers(1, 5))
    X = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-2, 1.5)
    y = rng.integers(0, 2, n)
    return X, y, dict(schedule=str(rng.choice(["parallel", "sequential"])), damping=float(rng.choice([0.0, 0.3])),
                      prior_var=float(10.0 ** rng.uniform(-1, 2)))


class _Perturbed:
    """A deliberately poor operator: the learned answer with its log variance multiplied by a
    random factor in [0.5, 2] and its mean moved by up to 0.5 cavity sd (fixed per problem)."""

    def __init__(self, op, rng):
        self.op, self.threshold = op, -6.0
        self.scale, self.shift = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0)))), float(rng.uniform(-0.5, 0.5))

    def predict(self, incoming, to):
        q, lv = self.op.predict(incoming, to)
        c = incoming["x"]
        return Gaussian(q.mean() + self.shift * np.sqrt(c.var()), q.var() ** self.scale * c.var() ** (1 - self.scale)), lv

    def belief(self, incoming, to):
        return self.predict(incoming, to)[0]


def _check_random(n_problems, seed, op):
    rng = np.random.default_rng(seed)
    outcomes = {"converged": 0, "max_iter": 0, "diverged": 0}
    for k in range(n_problems):
        X, y, p = _random_problem(rng)
        operator = op if k % 2 == 0 else _Perturbed(op, rng)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UncertainAnswerWarning)
            m = BayesianLogisticRegression(operator, max_iter=20, **p).fit(X, y)
        res = m.result_
        assert np.all(np.isfinite(res.mean)) and np.all(np.isfinite(res.cov)), (k, p)
        assert np.all(np.isfinite(m.predict_proba(X))), (k, p)
        outcomes[res.outcome] += 1
        if res.outcome == "diverged":
            assert res.status.startswith("diverged at iteration"), res.status
        elif res.outcome == "max_iter":
            assert "without convergence" in res.status
        else:
            assert res.status.startswith("converged")
    return outcomes


def test_random_problems_with_a_poor_learned_operator_never_return_nan(small_op):
    out = _check_random(60, seed=19, op=small_op)  # 1000 in benchmarks/soak.py
    assert out["converged"] > 0


def test_wrappers_that_forward_attributes_keep_their_belief_calls(small_op):
    """A recorder or tap forwarding attributes through __getattr__ must still see every call (the
    notebook's tap, kjit.ep.RecordingOperator): only operators whose class defines predict report
    uncertainty to the engine."""
    from kjit.ep import RecordingOperator
    from kjit.protocols import reports_uncertainty

    X, y = logistic_problem(15, 2, seed=1)
    rec = RecordingOperator(small_op)
    assert reports_uncertainty(small_op) and not reports_uncertainty(rec)
    res = LinearEP(rec, max_iter=3).run(X, _labels(y))
    assert len(rec.calls) == res.operator_calls == 3
