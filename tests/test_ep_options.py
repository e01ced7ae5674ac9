"""The EP engines' options (LinearEP, GraphEP, GPClassifier): every numeric option through one check
(kjit.ep.engine.check_number), every option checked whichever variant uses it, and relaxed EP that
cannot run refused before the run — or, failing at run time, reported, never a silent plain EP."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kjit.ep import GPClassifier, LinearEP, ProbitClassifier, ProbitNoiseOperator
from kjit.ep.engine import check_number
from kjit.ep.graph import FactorGraph, GraphEP
from kjit.families import Bernoulli, Gaussian

X5 = np.array([[1.0, 0.3], [0.8, 1.2], [-1.0, -0.2], [-0.6, -1.1], [2.0, 0.5]])
Y5 = np.array([1, 1, 0, 0, 0])


def _linear(**kw):
    return LinearEP(ProbitNoiseOperator(0.2), site_var="f", max_iter=50, **kw).run(
        X5, {"y": Bernoulli(Y5.astype(float))})


def _graph(**kw):
    g = FactorGraph()
    g.add_variable("w", Gaussian(0.0, 1.0))
    g.add_factor("probit_noise", {"f": "w", "y": Bernoulli(1.0)}, eps=0.2)
    return GraphEP(g, max_iter=50, **kw).run()


def _gp(**kw):
    return GPClassifier(eps=0.2, kernel="linear", max_iter=50, **kw).fit(X5, Y5)


# ------------------------------------------------------------------------ the one check
def test_check_number_refuses_what_is_not_a_number_in_range_and_names_it():
    for bad in ("0.5", None, True, np.bool_(False), np.array([0.5, 0.5]), 1j, [0.5]):
        with pytest.raises(ValueError, match=r"`opt` must be a finite real number, got"):
            check_number("opt", bad, 0.0, 1.0)
    for bad in (np.nan, np.inf, -np.inf, -0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match=r"`opt` must be a finite real number in \[0, 1\)"):
            check_number("opt", bad, 0.0, 1.0, high_open=True)
    with pytest.raises(ValueError, match="`opt` must be a finite real number > 0"):
        check_number("opt", 0.0, 0.0, low_open=True)
    with pytest.raises(ValueError, match="`n` must be an integer >= 3"):
        check_number("n", 2, 3, integer=True)
    for bad in (2.5, np.nan, True, "4"):
        with pytest.raises(ValueError, match="`n` must be an integer"):
            check_number("n", bad, 3, integer=True)
    assert check_number("opt", np.float32(0.25), 0.0, 1.0) == 0.25
    assert check_number("opt", np.array(0.5), 0.0, 1.0) == 0.5  # a 0-d array is its number
    assert check_number("n", 7.0, 3, integer=True) == 7 and isinstance(check_number("n", np.int64(7), integer=True), int)


# ------------------------------------------------------------------------ every engine uses it
@pytest.mark.parametrize("name,value", [
    ("power", "0.5"), ("power", True), ("power", np.array([0.5, 0.5])), ("power", None),
    ("damping", None), ("damping", "0.5"), ("damping", np.array([0.5, 0.5])), ("damping", True),
    ("relax_c", True), ("relax_c", "1"), ("tol", "1e-6"), ("max_iter", True), ("divergence_limit", "1e12"),
])
def test_linear_ep_refuses_non_numbers_naming_the_option(name, value):
    """Found by an audit: power="0.5" crashed in the cavity (numpy UFuncTypeError at
    ``1.0 - power * lam * v``), damping=None / "0.5" with "ufunc 'isfinite' not supported", an array
    damping with "truth value … ambiguous", and power=True / relax_c=True ran as 1."""
    kw = {"max_iter": 50} if name != "max_iter" else {}
    kw[name] = value
    with pytest.raises(ValueError, match=f"`{name}` must be"):
        LinearEP(ProbitNoiseOperator(0.2), site_var="f", **kw).run(X5, {"y": Bernoulli(Y5.astype(float))})


@pytest.mark.parametrize("name,value", [
    ("power", "0.5"), ("power", True), ("damping", None), ("damping", "0.5"), ("damping", np.array([0.1, 0.2])),
    ("tol", None), ("divergence_limit", "1e12"),
])
def test_graph_ep_refuses_non_numbers_naming_the_option(name, value):
    with pytest.raises(ValueError, match=f"`{name}` must be"):
        _graph(**{name: value})


def test_options_a_run_does_not_use_are_still_checked():
    """Found by an audit: ``LinearEP(relax_reading="bogus", relax_grid=-4)`` without relax_c ran, and
    ``GPClassifier(method="ep", power=-5, relax_c=-1)`` fitted; a typo is refused whatever the method."""
    with pytest.raises(ValueError, match="`relax_reading` must be one of"):
        _linear(relax_reading="bogus")
    with pytest.raises(ValueError, match="`relax_grid` must be an integer >= 3"):
        _linear(relax_grid=-4)
    for kw, name in ((dict(power=-5.0), "power"), (dict(relax_c=-1.0), "relax_c"), (dict(power=True), "power"),
                     (dict(relax_c=True), "relax_c"), (dict(relax_reading="bogus"), "relax_reading"),
                     (dict(alpha_tol="1e-3"), "alpha_tol"), (dict(eig_rtol=1.0), "eig_rtol"),
                     (dict(length_scale="1"), "length_scale"), (dict(damping="0.5"), "damping")):
        with pytest.raises(ValueError, match=f"`{name}` must be"):
            _gp(method="ep", **kw)
    with pytest.raises(ValueError, match="`power` must be"):
        _gp(method="rep", power=0.0)
    assert _gp(method="ep").converged_  # (the defaults pass)


# ------------------------------------------------------------------------ relaxed EP that cannot run
@pytest.mark.parametrize("reading", ["appendix_q", "appendix_site"])
def test_appendix_readings_are_refused_before_the_run_where_their_objective_is_undefined(reading):
    """The appendix's eq. 22 needs ε > 0 (ε log ε) and hard labels.  Found by an audit: with ε = 0 the
    operator raised in every line search, the engine fell back to plain EP each time, and the run returned
    EP's answer, n_relaxed 0, "converged", no warning.  Now the run is refused at the start, naming the
    option and why."""
    Xs, ys = X5[:4], Y5[:4]  # separable: ε = 0 is a proper model
    calls = []

    class Op(ProbitNoiseOperator):
        def belief(self, incoming, to, power=1.0):
            calls.append(1)
            return super().belief(incoming, to, power)

    with pytest.raises(ValueError, match=rf"relax_reading='{reading}' cannot be used.*eps > 0"):
        ProbitClassifier(Op(0.0), relax_c=0.01, relax_reading=reading, max_iter=200).fit(Xs, ys)
    assert calls == []  # refused before any update
    with pytest.raises(ValueError, match=rf"relax_reading='{reading}' cannot be used.*hard labels"):
        LinearEP(ProbitNoiseOperator(0.2), site_var="f", relax_c=0.01, relax_reading=reading).run(
            X5, {"y": Bernoulli(np.array([1.0, 0.7, 0.0, 0.0, 0.0]))})
    with pytest.raises(ValueError, match=rf"relax_reading='{reading}' cannot be used"):
        GPClassifier(eps=0.0, method="rep", relax_c=0.01, relax_reading=reading, max_iter=50).fit(Xs, ys)
    # where it is defined it runs and relaxes
    ok = ProbitClassifier(ProbitNoiseOperator(0.2), relax_c=1e-3, relax_reading=reading, max_iter=20).fit(X5, Y5)
    assert sum(r.n_relaxed for r in ok.result_.history) > 0


def test_a_line_search_that_fails_at_run_time_is_reported_not_silent():
    """A relaxation objective that fails during the run still gives the plain EP update, but counted
    (``n_relax_failed``), in the status, and warned — before, only an entry of ``history[i].errors``."""

    class Flaky(ProbitNoiseOperator):
        n = 0

        def projection_kl(self, incoming, to, power=1.0):
            Flaky.n += 1
            if Flaky.n == 3:
                raise RuntimeError("the line search's operator is down")
            return super().projection_kl(incoming, to, power)

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = LinearEP(Flaky(0.2), site_var="f", relax_c=1e-3, max_iter=30, schedule="parallel",
                       allow_negative_sites=True).run(X5, {"y": Bernoulli(Y5.astype(float))})
    failed = [r.n_relax_failed for r in res.history]
    assert sorted(failed)[-2:] == [0, 5] and sum(failed) == 5  # one iteration's batch of five fell back
    assert res.history[failed.index(5)].as_dict()["n_relax_failed"] == 5
    assert "5 relaxed-EP update(s) fell back to the plain EP update" in res.status
    assert "the line search's operator is down" in res.status
    assert any(issubclass(x.category, RuntimeWarning) and "fell back" in str(x.message) for x in w)
    # no failure: nothing said
    clean = LinearEP(ProbitNoiseOperator(0.2), site_var="f", relax_c=1e-3, max_iter=30,
                     allow_negative_sites=True).run(X5, {"y": Bernoulli(Y5.astype(float))})
    assert all(r.n_relax_failed == 0 for r in clean.history) and "fell back" not in clean.status


@pytest.mark.parametrize("bad", ["0.5", True, 0.0, -1.0, float("nan"), float("inf")])
def test_a_factors_power_is_checked_as_the_engines_check_it(bad):
    """``kjit.factors.base.check_power`` (a factor's exact rule for f^u) refuses what the engines refuse: text passed
    its ``float()`` before (one home: kjit.errors.check_number)."""
    from kjit.factors.base import check_power

    with pytest.raises(ValueError, match="`power`"):
        check_power(bad)
    assert check_power(0.5) == 0.5
