"""Families at extreme parameters, against mpmath at 50 digits (found by an audit, session 21): each
case is one where the textbook formula cancels, with the error it had and the tolerance the inputs'
own rounding allows (the KL is flat at its minimum: a near pair's KL is known to ~1e-16 relative of
its own size only if formed from the differences of the parameters, which the fixes do)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from kjit.families import Beta, Gamma, Gaussian

mp = pytest.importorskip("mpmath")
mp.mp.dps = 50


def _gamma_kl(a1, b1, a2, b2):
    a1, b1, a2, b2 = (mp.mpf(float(x)) for x in (a1, b1, a2, b2))
    return float((a1 - a2) * mp.digamma(a1) - mp.loggamma(a1) + mp.loggamma(a2) + a2 * (mp.log(b1) - mp.log(b2))
                 + a1 * (b2 - b1) / b1)


@pytest.mark.parametrize("a1,b1,a2,b2,was", [
    (1e12, 2e12, 1e12 * (1 + 1e-7), 2e12 * (1 + 1e-7), 3.7e-3),   # exact 2.5e-15
    (1e12, 1.0, 1e12 * (1 + 1e-6), 1 + 1e-6, 1.7e-7),            # exact 2.5e-13
    (476696.74305025255, 1.6932051182512051, 476696.71889736387, 1.6932050323674066, None),
    (3.9546152049860084e-07, 1838.2547145925314, 3.954615204240453e-07, 1838.2548050512644, None),  # tiny shapes
    (7509465204748.887, 1209653622.5430915, 0.0009401499281165808, 5.000626039882184e-07, None),  # far, mixed
    (2.5, 1.0, 2.5 * (1 + 1e-9), 1.0, None),
    (3.0, 2.0, 40.0, 0.01, None),
    # found in review of the first rewrite: a₂ ≪ a₁ (1 + t rounded a₂ away: inf / NaN / −409600) and a
    # mean-matched pair at a large shape (shape and rate parts, each ~a t², cancelled)
    (1e-3, 1.0, 1e-20, 1.0, None), (1e-5, 1.0, 1e-300, 1.0, None), (0.05, 1.0, 1e-18, 1.0, None),
    (1e20, 1.0, 1500.0, 1.5e-17, None), (1e20, 1.0, 1e5, 1e-15, None), (1e12, 1.0, 1e5, 1e-7, None),
    (1e12, 1.0, 6e11, 0.6, None), (1e12, 1.0, 4e11, 0.4, None), (2.59e11, 1.0, 2.33e11, 0.9, None),
    # mean-matched below 1e3 (the second review: 3.8e-10 relative), about the series' threshold 30
    (877.1863, 3.96e11, 777.4589, 3.96e11 * 777.4589 / 877.1863, None), (645.29, 2.53e-16, 711.69, 2.79e-16, None),
    (31.0, 1.0, 29.0, 1.0, None), (30.5, 1.0, 31.5, 1.03, None),
    # the rates' ratio underflowing in the Stirling form (forty-third session's audit: NaN)
    (50.0, 1e160, 60.0, 1e-160, None), (1e5, 1e300, 1e5, 1e-300, None), (1e6, 1e200, 1e6, 1e-120, None),
])
def test_gamma_kl_against_mpmath(a1, b1, a2, b2, was):
    got = float(Gamma(a1, b1).kl(Gamma(a2, b2)))
    ref = _gamma_kl(a1, b1, a2, b2)
    assert ref > 0
    assert got == pytest.approx(ref, rel=1e-12 if a1 < 1e10 else 1e-6), (got, ref, was)


def test_gamma_kl_is_never_negative_on_near_pairs_and_matches_mpmath():
    """Random pairs, shapes 1e-8…1e13 (second shapes down to 1e-300), near, mean-matched and far: 49 % of
    the near pairs beyond shape 1e5 had a negative KL before (−6.6e-3 where the true value is +6.0e-5)."""
    rng = np.random.default_rng(1)
    n = 400
    a1 = 10 ** rng.uniform(-8, 13, n)
    b1 = 10 ** rng.uniform(-10, 10, n)
    kind = rng.integers(0, 4, n)  # near, mean-matched, far, far with a tiny second shape
    f = 1 + rng.normal(size=n) * 10 ** rng.uniform(-9, -1, n)
    a2 = np.select([kind == 0, kind == 1, kind == 2], [a1 * (1 + rng.normal(size=n) * 10 ** rng.uniform(-9, -1, n)),
                                                       a1 * f, 10 ** rng.uniform(-8, 13, n)], 10 ** rng.uniform(-300, -8, n))
    b2 = np.select([kind == 0, kind == 1], [b1 * (1 + rng.normal(size=n) * 10 ** rng.uniform(-9, -1, n)), b1 * f],
                   10 ** rng.uniform(-10, 10, n))
    got = Gamma(a1, b1).kl(Gamma(a2, b2))
    ref = np.array([_gamma_kl(*p) for p in zip(a1, b1, a2, b2)])
    assert np.all(got >= 0)
    # relative 1e-6 (the far pairs with one shape ~1e13 are known only to ~1e-7 from their inputs' rounding)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)


def test_kl_of_two_messages_is_a_scalar():
    for p, q in ((Gamma(2.0, 1.0), Gamma(3.0, 1.0)), (Gaussian(0.0, 1.0), Gaussian(0.0, 2.0)),
                 (Beta(2.0, 1.0), Beta(3.0, 1.0))):
        k = p.kl(q)
        assert isinstance(k, float) and np.ndim(k) == 0, type(k)


def test_gamma_kl_batches_broadcast():
    p = Gamma(np.array([1e12, 2.0, 1e-3]), 1.0)
    q = Gamma(np.array([[1e12 * (1 + 1e-6)], [3.0]]), np.array([[1.0], [2.0]]))
    got = p.kl(q)
    assert got.shape == (2, 3)
    ref = np.array([[_gamma_kl(a1, 1.0, a2, b2) for a1 in (1e12, 2.0, 1e-3)] for a2, b2 in ((1e12 * (1 + 1e-6), 1.0),
                                                                                            (3.0, 2.0))])
    np.testing.assert_allclose(got, ref, rtol=1e-9)


@pytest.mark.parametrize("a,b,was", [(100.0, 1e-8, 7.2e-6), (9999.0, 1e-8, 6.1e-5), (30.0, 1e-10, 6.4e-5),
                                     (9999.0, 1e-12, 1.0), (1e-8, 100.0, None), (5000.0, 1e-6, None)])
def test_beta_log_statistics_with_one_tiny_parameter(a, b, was):
    """E[log x] = ψ(α) − ψ(α + β) where β ≪ α < 1e4: the direct difference cancelled to ~1e-16 ψ(α),
    all of a value ~β/α (Beta(9999, 1e-12) gave 0 for −1.0e-16)."""
    e = Beta(a, b).expected_suff_stats()
    ref = [float(mp.digamma(mp.mpf(a)) - mp.digamma(mp.mpf(a) + mp.mpf(b))),
           float(mp.digamma(mp.mpf(b)) - mp.digamma(mp.mpf(a) + mp.mpf(b)))]
    np.testing.assert_allclose(e, ref, rtol=1e-13)


@pytest.mark.parametrize("a,b", [(4372.0, 4.304e-9), (8.14e-9, 1437.0), (1e4, 1e-8), (100.0, 1e-8)])
def test_beta_project_of_exact_statistics_with_one_tiny_parameter(a, b):
    """Beta.project fed the exact (mpmath, correctly rounded) statistics: Beta(4372, 4.3e-9) came back
    7.2e-4 off (its Newton steps used the cancelling ψ difference)."""
    A, B = mp.mpf(a), mp.mpf(b)
    ess = np.array([float(mp.digamma(A) - mp.digamma(A + B)), float(mp.digamma(B) - mp.digamma(A + B))])
    q = Beta.project(ess)
    np.testing.assert_allclose([float(q.alpha), float(q.beta)], [a, b], rtol=1e-12)


@pytest.mark.parametrize("flip", [False, True])
def test_beta_project_where_one_statistic_is_huge(flip):
    """One parameter 1e-12–1e-10 against one 0.02–1 (either side), statistics from mpmath rounded to doubles: one is
    ~−1/α, ~5e10 in magnitude.  Beta.project's step halving compared r1² + r2², where that statistic's rounding
    (~1e-5) outweighed the other equation's whole residual, so every step improving it looked worse; halved to
    nothing, the step passed the test on the change — 1e-6 to 1.4e-5 off, reported converged (these are the cases
    of 2 000 draws, one parameter 1e-12–1e-9 and the other 1e-3–1e6, where it was beyond 1e-9: 0.35 %; and two from
    benchmarks/beta_precision.py's proj_tiny).  Tolerance: the solver's own 1e-12 — the statistics determine the
    parameters to ~2e-16 here (condition number ~1–2, mpmath); measured ≤ 1.9e-15 over proj_tiny's 400."""
    cases = [(2.5096891149488644e-12, 0.05307625852043937), (1.933479133996855e-11, 0.06434008280207112),
             (1.3577387606523992e-10, 0.625507555067797), (1.8537089429253496e-11, 0.21721358018540451),
             (1.8579017270147398e-11, 0.6342250073345878), (2.552815611645703e-12, 0.021332427850820224)]
    a, b = np.array(cases).T[::-1] if flip else np.array(cases).T
    ess = np.array([[float(mp.digamma(A) - mp.digamma(A + B)), float(mp.digamma(B) - mp.digamma(A + B))]
                    for A, B in ((mp.mpf(x), mp.mpf(y)) for x, y in zip(a, b))])
    q = Beta.project(ess)
    np.testing.assert_allclose(q.alpha, a, rtol=1e-12)
    np.testing.assert_allclose(q.beta, b, rtol=1e-12)


def test_beta_project_says_when_it_did_not_converge():
    """Beta.project returned whatever max_iter left it with, silently; elements not within tol (nor within what
    their statistics determine) are named in a RuntimeWarning now — and none where it converges."""
    ess = Beta(np.array([2.0, 1e-10]), np.array([3.0, 50.0])).expected_suff_stats()
    with pytest.warns(RuntimeWarning, match=r"1 element\(s\) did not converge in 6 Newton steps .*\[1\]"):
        Beta.project(ess, max_iter=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = Beta.project(ess)
    np.testing.assert_allclose(q.alpha, [2.0, 1e-10], rtol=1e-12)


def test_concatenate_along_the_last_batch_axis_keeps_every_message():
    """Messages built from natural parameters (every product, quotient, power) were concatenated through
    natural(), whose last axis is the statistics': axis=-1 dropped the second batch."""
    eta1 = np.stack([np.arange(6.0).reshape(2, 3), -0.5 * np.ones((2, 3))], -1)
    eta2 = np.stack([10 + np.arange(6.0).reshape(2, 3), -0.25 * np.ones((2, 3))], -1)
    g1, g2 = Gaussian.from_natural(eta1), Gaussian.from_natural(eta2)
    p1, p2 = Gaussian(g1.mean(), g1.var()), Gaussian(g2.mean(), g2.var())
    for axis in (-1, 1):
        got, ref = Gaussian.concatenate([g1, g2], axis=axis), Gaussian.concatenate([p1, p2], axis=axis)
        assert got.shape == ref.shape == (2, 6)
        np.testing.assert_allclose(got.mean(), ref.mean())
        np.testing.assert_allclose(got.var(), ref.var())
    a, b = Gaussian.from_natural(np.array([[1.0, -0.5], [2.0, -0.5]])), Gaussian.from_natural(np.array([[3.0, -0.5]]))
    with pytest.raises(np.exceptions.AxisError):
        Gaussian.concatenate([a, b], axis=1)  # (as the plain parameters' path: no second batch axis)
    assert Gaussian.concatenate([a, b], axis=-1).shape == (3,)


@pytest.mark.parametrize("a", [1e-15, 1e-18, 1e-20, 1e-25])
def test_gamma_project_of_a_tiny_shape(a):
    """Minka's start (3 − s + √((s − 3)² + 24s)) / 12s cancelled to 0 for s = ln E[x] − E[log x] ≳ 1e18:
    the statistics of Gamma(1e-18, 1) were refused (shape 0)."""
    ess = np.array([a, float(mp.digamma(mp.mpf(a)))])
    q = Gamma.project(ess)
    assert float(q.shape_param) == pytest.approx(a, rel=1e-12) and float(q.rate) == pytest.approx(1.0, rel=1e-12)


def test_variances_that_overflow_only_in_their_formula():
    assert float(Beta(1e120, 1e120).var()) == pytest.approx(1.25e-121, rel=1e-12)  # was 0
    assert float(Gamma(1e-200, 1e-200).var()) == pytest.approx(1e200, rel=1e-12)  # was inf
    assert Beta(2.0, 3.0).var() == 2.0 * 3.0 / (25.0 * 6.0) and Gamma(2.0, 3.0).var() == 2.0 / 9.0


def _gauss_kl(m1, v1, m2, v2):
    m1, v1, m2, v2 = (mp.mpf(float(x)) for x in (m1, v1, m2, v2))
    return float((v1 / v2 - 1 - mp.log(v1 / v2) + (m1 - m2) ** 2 / v2) / 2)


@pytest.mark.parametrize("m1,v1,m2,v2", [(0.0, 1e-200, 0.0, 1e200), (0.0, 1e-170, 0.0, 1e170), (0.3, 2.0, 0.3, 2.0 * (1 + 1e-9)),
                                         (0.0, 1e-12, 0.0, 1.0), (0.0, 1e-17, 0.0, 1.0), (0.0, 1e-100, 0.0, 1.0),
                                         (0.0, 2.1595796931612213e266, 0.0, 1.4397197954354244e266),
                                         (1.0, 1.0, 1.0 + 1e-8, 1.0 + 1e-7), (0.0, 1.0, 5.0, 3.0)])
def test_gaussian_kl_against_mpmath(m1, v1, m2, v2):
    """r − 1 − ln r lost a near pair's digits ((r − 1)²/2 formed from O(1) terms) and was inf for a finite
    KL where v1/v2 underflowed (391 at 1e-170 against 1e170)."""
    got = float(Gaussian(m1, v1).kl(Gaussian(m2, v2)))
    assert got == pytest.approx(_gauss_kl(m1, v1, m2, v2), rel=1e-13)
    assert float(Gaussian(0.0, 1e200).kl(Gaussian(0.0, 1e-200))) == np.inf  # (was NaN)
    # a subnormal ratio: r − 1 rounds to −1, ln r from the logs
    assert float(Gaussian(0.0, 1e-320).kl(Gaussian(0.0, 1.0))) == pytest.approx(0.5 * (320 * np.log(10) - 1), rel=1e-3)


def test_beta_kl_with_a_parameter_near_the_smallest_double():
    """x1·x2 underflowed in the ln B difference: NaN for Beta(1e-170, 1) against Beta(2e-170, 1)."""
    a1, a2 = mp.mpf(1e-170), mp.mpf(2e-170)
    with mp.workdps(60):
        ref = (mp.log(mp.beta(a2, 1)) - mp.log(mp.beta(a1, 1)) + (a1 - a2) * (mp.digamma(a1) - mp.digamma(a1 + 1)))
    assert float(Beta(1e-170, 1.0).kl(Beta(2e-170, 1.0))) == pytest.approx(float(ref), rel=1e-12)


def test_gamma_log_pdf_at_large_shapes_against_mpmath():
    """a ln b − ln Γ(a) + (a − 1) ln x − b x adds terms of ~a ln a: 3.5e-3 relative off at shape 1e12 and
    0.84 at 1e15 (found by an audit).  From shape 30 by Stirling's series, the error is what the inputs'
    rounding allows: eps times the density's sensitivity to ln x, |a − 1 − b x|, plus eps |log p|."""
    mp.mp.dps = 60
    rng = np.random.default_rng(0)
    eps = np.finfo(float).eps
    for a in (0.5, 3.0, 29.0, 30.0, 1e3, 1e6, 1e9, 1e12, 1e15):
        for b in (1e-3, 1.0, 7.3e5):
            m, sd = a / b, np.sqrt(a) / b
            xs = np.concatenate([m + sd * rng.normal(size=10), m * np.array([1e-3, 0.5, 2.0, 10.0])])
            xs = xs[xs > 0]
            got = Gamma(np.full(xs.size, a), np.full(xs.size, b)).log_pdf(xs)
            for g, x in zip(got, xs):
                A, B, X = mp.mpf(a), mp.mpf(b), mp.mpf(float(x))
                ref = float(A * mp.log(B) - mp.loggamma(A) + (A - 1) * mp.log(X) - B * X)
                if a < 30:  # (the textbook sum: eps times its terms, which are small below 30)
                    terms = [A * mp.log(B), mp.loggamma(A), (A - 1) * mp.log(X), B * X]
                    bound = 10 * eps * (sum(abs(float(t)) for t in terms) + 1)
                else:
                    bound = 10 * eps * (abs(float(A - 1 - B * X)) + abs(ref) + 1)
                assert abs(g - ref) <= bound, (a, b, x, g, ref)


def test_beta_log_pdf_at_large_parameters_against_mpmath():
    """(α − 1) ln x + (β − 1) ln(1 − x) − ln B(α, β) adds terms of ~(α + β) ln 2: 1.3e-5 off at Beta(1e12,
    1e12) and 0.12 at (1e15, 3e15) (session 22's leftover).  Where α − 1, β − 1 > 1e5 it is formed about
    the mode from the logit of x; the error is then what the inputs' rounding allows: eps times the
    density's sensitivity to ln x, |α − 1 − (β − 1) x / (1 − x)|, plus eps |log p| (below, eps times the
    sum's terms: 2e-12 at Beta(1e4, 1e4))."""
    rng = np.random.default_rng(1)
    eps = np.finfo(float).eps
    with mp.workdps(60):
        for a, b in [(0.5, 3.0), (40.0, 60.0), (1e4, 1e4), (2e5, 3e5), (1e6, 1e6), (1e9, 2e9), (1e12, 1e12),
                     (1e15, 3e15), (1e12, 50.0), (3.0, 1e10)]:
            m, sd = a / (a + b), float(np.sqrt(Beta(a, b).var()))
            xs = np.concatenate([m + sd * rng.normal(size=8), m + sd * np.array([-30.0, 30.0]), [m / 2, (1 + m) / 2]])
            xs = xs[(xs > 0) & (xs < 1)]
            got = Beta(np.full(xs.size, a), np.full(xs.size, b)).log_pdf(xs)
            for g, x in zip(got, xs):
                A, B, X = mp.mpf(a), mp.mpf(b), mp.mpf(float(x))
                ref = float((A - 1) * mp.log(X) + (B - 1) * mp.log(1 - X) - mp.log(mp.beta(A, B)))
                if min(a, b) - 1 <= 1e5:  # (the textbook sum: eps times its terms)
                    terms = [(A - 1) * mp.log(X), (B - 1) * mp.log(1 - X), mp.log(mp.beta(A, B))]
                    bound = 10 * eps * (sum(abs(float(t)) for t in terms) + 1)
                else:
                    bound = 10 * eps * (abs(float((A - 1) - (B - 1) * X / (1 - X))) + abs(ref) + 1)
                assert abs(g - ref) <= bound, (a, b, x, g, ref)
    # the logit form agrees with the same density, and is the logistic factor's label density
    from kjit.factors.logistic import log_label_density

    t = np.array([-2.0, 0.0, 1e-6, 3.0])
    for a, b in [(2.0, 3.0), (1e12, 1e12), (4e14, 1e15)]:
        x = 1.0 / (1.0 + np.exp(-t))
        assert np.array_equal(Beta(a, b).log_pdf_logit(t), log_label_density(t, a, b))
        if a < 1e5:
            assert np.allclose(Beta(a, b).log_pdf_logit(t), Beta(a, b).log_pdf(x), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("a,b,was", [
    (0.5, 2e5, 1.3e-10), (30.0, 1e7, 1.3e-10), (1e4, 1e10, 7.8e-11), (1e-10, 2e5, 8.3e-12),
    (1e100, 1e300, float("nan")), (1e300, 1e300, 1.7e-13), (1e-300, 1e300, 0.0), (1e-3, 1e300, 0.0),
    (0.5, 10.0, 0.0), (3.0, 29.99, 0.0), (29.99, 30.0, 0.0), (1e12, 1e12, 1e-2), (1e-300, 1e-300, 0.0),
])
def test_log_beta_against_mpmath(a, b, was):
    """ln B(a, b) by Stirling's series wherever an argument reaches 30 (scipy's betaln, used below 1e5
    until the twenty-third session, was off by `was` relative, NaN at (1e100, 1e300)); 400 digits,
    so that ln Γ(1e300)'s 303 integer digits cancel exactly in the reference."""
    from kjit.families import log_beta

    with mp.workdps(400):
        ref = float(mp.loggamma(mp.mpf(a)) + mp.loggamma(mp.mpf(b)) - mp.loggamma(mp.mpf(a) + mp.mpf(b)))
    for x, y in ((a, b), (b, a)):
        assert float(log_beta(x, y)) == pytest.approx(ref, rel=4e-15, abs=4e-15)


@pytest.mark.parametrize("a,b,x,t", [
    (2e21, 1e5 + 2, 0.5, None),          # β/α below eps, x below the mode: 1 + w rounded to 0 (+inf)
    (1e12, 1e12, 1e-310, None),          # |t − t₀| beyond 709: e^|d| overflowed (−inf)
    (1e12, 1e12, None, -720.0),
    (3e5, 2e5, None, 800.0),
    (1e200, 1e160, None, 0.0),           # α β overflows (NaN)
    (1e200, 1e160, None, 95.0),
])
def test_beta_log_density_about_the_mode_far_from_it(a, b, x, t):
    """The concentrated form (beta_log_pdf_logit) far from its mode: found in review, +inf, −inf or NaN
    where the textbook sum was right.  Against mpmath at 80 digits, to eps times the magnitude."""
    from kjit.families import beta_log_pdf_logit

    with mp.workdps(80):
        A, B = mp.mpf(a), mp.mpf(b)
        if t is None:
            X = mp.mpf(x)
            lx, l1x = mp.log(X), mp.log(1 - X)
            got = float(Beta(a, b).log_pdf(x))
        else:
            T = mp.mpf(t)
            lx, l1x = -mp.log(1 + mp.exp(-T)), -mp.log(1 + mp.exp(T))
            got = float(beta_log_pdf_logit(t, a, b))
        ref = float((A - 1) * lx + (B - 1) * l1x - (mp.loggamma(A) + mp.loggamma(B) - mp.loggamma(A + B)))
    assert np.isfinite(got)
    assert abs(got - ref) <= 1e-14 * abs(ref) + 1e-9


def test_log_beta_outside_its_domain_is_betalns():
    """ln B with a zero, infinite or negative argument is scipy's (inf, −inf, ln|B|): the Stirling form
    gave NaN where the other argument reached 30 (found in review)."""
    from scipy import special

    from kjit.families import log_beta

    for a, b in [(0.0, 100.0), (np.inf, 100.0), (-0.5, 100.0), (0.0, 1.0), (100.0, 0.0)]:
        assert float(log_beta(a, b)) == pytest.approx(float(special.betaln(a, b)), rel=1e-15) \
            or float(log_beta(a, b)) == float(special.betaln(a, b))


def _beta_kl(a1, b1, a2, b2):
    with mp.workdps(150):  # (terms ~1e100 · ψ cancel to the KL: 50 digits gave 0 for 676)
        a1, b1, a2, b2 = (mp.mpf(float(x)) for x in (a1, b1, a2, b2))
        return float(mp.log(mp.beta(a2, b2)) - mp.log(mp.beta(a1, b1)) + (a1 - a2) * mp.digamma(a1)
                     + (b1 - b2) * mp.digamma(b1) + (a2 - a1 + b2 - b1) * mp.digamma(a1 + b1))


@pytest.mark.parametrize("p,q,tol", [
    # found by an audit (forty-third session): inf, NaN, 1.5 nats off, negative, 75× off
    ((1e16, 1.0), (1.0, 1.0), 1e-12), ((1e12, 1e-6), (1e-6, 1e-6), 1e-12), ((1e10, 1e-7), (1e-6, 1e-6), 1e-12),
    ((578817.9180813476, 91798.64210551826), (1.0214540137371351e-06, 2.4129613309251706e-06), 1e-6),
    ((10.0, 7.0), (10.0 + 1e-8, 7.0 + 1e-8), 1e-10), ((1e12, 3e12), (1e12 * 1.001, 3e12 * 1.001), 1e-6),
    ((1e12, 1e12), (1e12 * (1 + 1e-5), 1e12 * (1 + 1e-5)), 1e-6),
    # found in review of the fix: far pairs from parameters ~1e14 (the exact difference's products cancelled)
    ((1.49294818e14, 2.06210539e14), (0.03880323, 0.29307947), 1e-12),
    # and of the second: a mixed near pair (0 for 1.3e-5), tiny parameters taken as near (0 for 1e130), a ratio that
    # overflows in the far form (NaN)
    ((0.01, 1e15), (0.01, 0.95e15), 1e-10), ((1e-170, 1e-300), (1e-20, 1e-170), 1e-10),
    ((1e-6, 1e100), (1e-300, 1e16), 1e-10), ((1.0, 1.0), (1e-300, 1e10), 1e-10),
])
def test_beta_kl_audit_cases_against_mpmath(p, q, tol):
    """Relative tolerances: far pairs 1e-12 (test_beta_kl_far_pairs_against_mpmath says why; where a parameter
    changed by 16 orders the rounding of the textbook form's huge terms, ~1e14 each for a sum ~30, left ~1 %); a
    near pair's KL is formed from the parameters' differences (1e-10)."""
    got = float(Beta(*p).kl(Beta(*q)))
    want = _beta_kl(*p, *q)
    assert np.isfinite(got) and got > 0 and abs(got - want) <= tol * want, (got, want)


@pytest.mark.parametrize("kind", ["near", "mean_matched", "near_wide", "lopsided", "far"])
def test_beta_kl_is_positive_and_close_to_mpmath_over_random_pairs(kind):
    """60 pairs a kind (seeded): near pairs at parameters 0.1–100 (relative changes 1e-9–1e-5) to 1e-11 relative
    (the general form's absolute 1e-14 made 7.6 % of them negative); mean-matched pairs at 1e-3–1e14 (both
    parameters scaled by 1 + 1e-8…1e-2) to 1e-10, measured ≤ 2.6e-13 over 300 (up to 2e4 before); near pairs at
    1e-3–1e14 (changes 1e-8–0.1) to 1e-3, measured ≤ 4.2e-5 over 300 (8.2 before); one parameter 0.01–30, the other
    1e3–1e15, both moved within a tenth (review of the first rewrite: 0 for 1.3e-5) to 1e-10, measured ≤ 1.2e-12;
    far pairs at 1e-6–1e16 to 1e-12 (test_beta_kl_far_pairs_against_mpmath says why), measured ≤ 1.1e-2 by the
    textbook form with ln B's differences (up to 5.6e11 before that, 3 % inf or NaN) — there its terms are ~1e16 and
    the KL ~20."""
    rng = np.random.default_rng({"near": 1, "mean_matched": 2, "near_wide": 4, "lopsided": 5, "far": 3}[kind])
    if kind == "near":
        p = 10 ** rng.uniform(-1, 2, (60, 2))
        q, tol = p * (1 + 10 ** rng.uniform(-9, -5, p.shape) * rng.choice([-1, 1], p.shape)), 1e-11
    elif kind == "mean_matched":
        p = 10 ** rng.uniform(-3, 14, (60, 2))
        q, tol = p * (1 + 10 ** rng.uniform(-8, -2, (60, 1))), 1e-10
    elif kind == "near_wide":
        p = 10 ** rng.uniform(-3, 14, (60, 2))
        q, tol = p * (1 + 10 ** rng.uniform(-8, -1, p.shape) * rng.choice([-1, 1], p.shape)), 1e-3
    elif kind == "lopsided":
        p = np.column_stack([10 ** rng.uniform(-2, np.log10(30), 60), 10 ** rng.uniform(3, 15, 60)])
        q, tol = p * (1 + rng.uniform(-0.09, 0.09, p.shape)), 1e-10
    else:
        p, q, tol = 10 ** rng.uniform(-6, 16, (60, 2)), 10 ** rng.uniform(-6, 16, (60, 2)), 1e-12
    got = Beta(p[:, 0], p[:, 1]).kl(Beta(q[:, 0], q[:, 1]))
    want = np.array([_beta_kl(*p[i], *q[i]) for i in range(len(p))])
    assert np.all(np.isfinite(got)) and np.all(got > 0)
    np.testing.assert_allclose(got, want, rtol=tol, atol=0)


@pytest.mark.parametrize("kind", ["far", "drop", "scale", "half"])
def test_beta_kl_far_pairs_against_mpmath(kind):
    """Pairs that are not near (_beta_kl_far), 80 a kind (seeded): every parameter log-uniform on 1e-12–1e16; p's
    1e12–1e16 against q's 1e-12–1e2 (a concentrated Beta against a broad one: the textbook form's terms ~1e16 cancel
    to a KL ~20, and it was up to 37 % off, 8 % on the first kind); q = p·10^±U(0.05, 16) (mean-matched: 4 % off);
    one parameter kept, the other log-uniform (the smaller kept and tiny: a KL ~ the smaller, ~1e-12, 3 % off).
    Tolerance 1e-12: the KL's condition number κ = Σ|θ ∂KL/∂θ|/KL is below ~40 on these draws (mpmath), so the
    inputs' own rounding leaves ≲ 40 ulp; the far form's parts are each within a few hundred ulp of themselves (the
    worst: ψ(x) − ln x below 30, ~200 ulp at 29; ln m1 − ln m2 from logs) and at most ~10× the KL, ≲ 2e3 ulp ≈ 4e-13;
    measured ≤ 2.0e-13 over 400 pairs a kind (benchmarks/beta_precision.py)."""
    rng = np.random.default_rng({"far": 11, "drop": 12, "scale": 13, "half": 14}[kind])
    n = 80
    p = 10 ** rng.uniform(-12, 16, (n, 2))
    if kind == "far":
        q = 10 ** rng.uniform(-12, 16, (n, 2))
    elif kind == "drop":
        p, q = 10 ** rng.uniform(12, 16, (n, 2)), 10 ** rng.uniform(-12, 2, (n, 2))
    elif kind == "scale":
        q = p * 10 ** (rng.uniform(0.05, 16, (n, 1)) * rng.choice([-1, 1], (n, 1)))
    else:
        q, j = p.copy(), rng.integers(0, 2, n)
        q[np.arange(n), j] = 10 ** rng.uniform(-12, 16, n)
    got = Beta(p[:, 0], p[:, 1]).kl(Beta(q[:, 0], q[:, 1]))
    want = np.array([_beta_kl(*p[i], *q[i]) for i in range(n)])
    assert np.all(np.isfinite(got)) and np.all(got > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_beta_mean_where_the_parameters_sum_overflows():
    """α + β overflows beyond ~9e307 (audit, forty-third session: Beta(1e308, 1e308).mean() was 0.0)."""
    np.testing.assert_allclose(Beta([1e308, 1e308, 2.0], [1e308, 1e307, 3.0]).mean(), [0.5, 10 / 11, 0.4], rtol=1e-15)


def test_batches_that_do_not_broadcast_and_negative_variances_are_named():
    """Audit (forty-third session): KL between batches of 2 and 3 messages met numpy's broadcast error mid-formula;
    least_expected_kl with a negative variance returned NaN."""
    with pytest.raises(ValueError, match=r"cannot compare Gaussian batches of shapes \(2,\) and \(3,\)"):
        Gaussian([0.0, 1.0], [1.0, 1.0]).kl(Gaussian([0.0, 1.0, 2.0], [1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"cannot multiply Beta batches of shapes \(2,\) and \(3,\)"):
        Beta([1.0, 2.0], [1.0, 1.0]) * Beta([1.0, 2.0, 3.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"`var` must be >= 0"):
        Gaussian.least_expected_kl([[0.0, 0.0]], [[-1.0, 1.0]])
    # (a batch against one message still broadcasts; a NaN variance stays NaN: never confident)
    np.testing.assert_allclose(Gaussian([0.0, 1.0], [1.0, 2.0]).kl(Gaussian(0.5, 1.0)), [0.125, 0.27842641], rtol=1e-7)
    assert np.isnan(Gaussian.least_expected_kl([[0.0, 0.0]], [[np.nan, 1.0]]))[0]


@pytest.mark.parametrize("fam,params,name", [
    (Beta, (1e-310, 1.0), "alpha"), (Beta, (1.0, 5e-324), "beta"), (Gamma, (1e-320, 1.0), "shape"),
    (Gamma, ([1.0, 2.0], [1.0, 1e-309]), "rate")])
def test_subnormal_beta_and_gamma_parameters_are_refused_by_name(fam, params, name):
    """Audit (forty-third session): a subnormal parameter was accepted and gave NaN (Beta(1e-310, 1).kl(Beta(1, 1)),
    Beta(5e-324, 1).kl(itself)): its reciprocal and digamma overflow.  Refused now, named; one message and a batch
    alike."""
    with pytest.raises(ValueError, match=rf"{fam.__name__}: `{name}` must be at least 2.2250738585072014e-308"):
        fam(*params)


@pytest.mark.parametrize("p,q", [((1e-300, 1.0), (1.0, 1.0)), ((1e-300, 1e-300), (1e-300, 1.0)),
                                 ((2.3e-308, 1.0), (1.0, 1.0)), ((1.0, 1e-300), (2.0, 3.0))])
def test_the_smallest_normal_parameters_keep_finite_kls(p, q):
    """Just above the subnormals every KL is finite and as mpmath's (terms ~1e300 cancel to it); Beta(ε, ε)'s
    variance is 1/4 (α·β underflowed: NaN)."""
    got = float(Beta(*p).kl(Beta(*q)))
    assert np.isfinite(got) and got == pytest.approx(_beta_kl(*p, *q), rel=1e-12)
    got = float(Gamma(*p).kl(Gamma(*q)))
    assert np.isfinite(got) and got == pytest.approx(_gamma_kl(*p, *q), rel=1e-12)
    assert float(Beta(1e-300, 1e-300).var()) == pytest.approx(0.25, rel=1e-15)


def test_an_integer_beyond_a_double_and_coordinates_of_the_wrong_width_are_named():
    """Audit (forty-third session): Gaussian(10**400, 1) raised OverflowError naming nothing; fisher_information
    given three columns for a two-coordinate family met numpy's errors mid-formula."""
    with pytest.raises(ValueError, match=r"Gaussian: `mean` must be real numbers"):
        Gaussian(10**400, 1.0)
    with pytest.raises(ValueError, match=r"Gamma: `rate` must be real numbers"):
        Gamma(1.0, [1, 10**400])
    for fam in (Gaussian, Beta, Gamma):
        with pytest.raises(ValueError, match=rf"{fam.__name__}.fisher_information: `coords` must have last axis of "
                                             r"length 2 .* got shape \(4, 3\)"):
            fam.fisher_information(np.zeros((4, 3)))
        with pytest.raises(ValueError, match=r"(fisher_information|decision_weights): `coords`"):
            fam.decision_weights(np.zeros((4, 1)))


def test_beta_kl_with_parameters_far_below_1e_30_against_mpmath():
    """ψ(x) − ψ(x + y) with x ≤ 1e-30 and y ≪ x (below Taylor's series' range: x + y rounds to x) was 0 for
    −y/(x(x + y)), and the far form's KL with it half the truth or 1e103 off (found in review; parameters down to
    1e-100 are accepted by the service).  Tolerance 1e-12: every part here is ~1/x, formed without cancellation."""
    def exact(a1, b1, a2, b2):
        with mp.workdps(800):
            a1, b1, a2, b2 = map(mp.mpf, (a1, b1, a2, b2))
            lb = lambda a, b: mp.loggamma(a) + mp.loggamma(b) - mp.loggamma(a + b)  # noqa: E731
            return float(lb(a2, b2) - lb(a1, b1) + (a1 - a2) * (mp.digamma(a1) - mp.digamma(a1 + b1))
                         + (b1 - b2) * (mp.digamma(b1) - mp.digamma(a1 + b1)))

    cases = [(1e-100, 1e-80, 1e-60, 1e-20), (3e-243, 1.7e-218, 3.6e-169, 1.9e-16), (1e-40, 1e-31, 0.5, 2.0),
             (2e-35, 1e-31, 3e-35, 5e-31)]
    got = Beta(*[np.array(c) for c in zip(*cases)][:2]).kl(Beta(*[np.array(c) for c in zip(*cases)][2:]))
    for g, c in zip(got, cases):
        t = exact(*c)
        assert abs(g - t) <= 1e-12 * abs(t), (c, g, t)
    from kjit.families import _digamma_diff

    for x, y in [(1e-80, 1e-100), (1e-31, 1e-40), (1e-200, 1e-210)]:
        with mp.workdps(800):
            t = float(mp.digamma(mp.mpf(x)) - mp.digamma(mp.mpf(x) + mp.mpf(y)))
        assert abs(float(_digamma_diff(x, y)) - t) <= 1e-12 * abs(t)
    # α + β beyond the largest double: no finite answer rather than a wrong one (it gave 1.15 for 0.70)
    assert not np.isfinite(Beta(1e308, 1e308).kl(Beta(1e307, 1e307)))
    assert abs(Beta(8.9e307, 8.9e307).kl(Beta(1e307, 1e307)) - exact(8.9e307, 8.9e307, 1e307, 1e307)) <= 1e-12
