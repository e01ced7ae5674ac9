"""Exact EP rules of kjit.exact (product, gaussian, gamma_rate, exp) against independent computations.

References
----------
Each belief is checked against a *different reduction* of the same tilted integral, integrated by
a *different engine* (scipy's adaptive Gauss–Kronrod ``quad_vec``, epsrel 1e-13, every moment in
one vector integral, centred second pass for variances):

* product: the rule integrates over x (beliefs on x, z) / y (belief on y); the reference integrates
  over the *other* input: given y, x ↦ z is linear, so x's and z's beliefs are mixtures of their
  Gaussian posteriors given y;
* gaussian: the rule integrates over τ; the reference integrates over d = x − m (τ out in closed
  form: a Student-t in d, and τ | d ~ Gamma(a + α/2, b + α d²/2); m | d Gaussian);
* gamma_rate: the belief on r is checked through the integral over x (r | x ~ Gamma(αs + a_r,
  b_r + αx)) and the belief on x through the integral over r (x | r ~ Gamma(c, αr + b_x));
* exp: one variable only; the reference is the same integral in x by quad_vec (independent engine).

Agreement is asserted to ≤ 1e-8 relative in the beliefs' parameters (a Gaussian mean relative to
max(|mean|, sd)), the target the reference (≈1e-12 here) allows.  Also a direct Monte Carlo check
of each log partition with its standard error (through each module's own sampler), Infer.NET's
GammaFromShapeAndRate test, power EP, and bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import integrate, special

from kjit.exact import FACTORS, exp, gamma_rate, gaussian, product
from kjit.families import Beta, Gamma, Gaussian
from kjit.oracles import OracleError

TOL = 1e-8


# ------------------------------------------------------------------------------ reference engine
def qvec(logw, funcs, lo, hi, points):
    """log ∫ e^{logw} and E[g] for g in funcs, by quad_vec (one adaptive vector integral)."""
    pts = sorted({float(p) for p in points if lo < p < hi})
    L = max(logw(p) for p in pts + [0.5 * (lo + hi)] if np.isfinite(logw(p)))

    def f(t):
        with np.errstate(all="ignore"):
            w = np.exp(logw(t) - L)
            vals = [1.0] + [g(t) for g in funcs]
        return np.array([w * v if w > 0 else 0.0 for v in vals])

    r, _ = integrate.quad_vec(f, lo, hi, points=pts or None, epsabs=0, epsrel=1e-13, norm="max", limit=20000)
    return np.log(r[0]) + L, r[1:] / r[0]


def ref_gaussian_mixture(logw, mu, s2, lo, hi, points):
    """Moments of the logw-mixture of N(mu(t), s2(t)) (centred second pass)."""
    lz, (m0,) = qvec(logw, [mu], lo, hi, points)
    _, (e2, e1) = qvec(logw, [lambda t: (mu(t) - m0) ** 2 + s2(t), lambda t: mu(t) - m0], lo, hi, points)
    return lz, m0 + e1, e2 - e1 * e1


def ref_gamma(logw, cond, lo, hi, points, v0, projection="kl"):
    """Gamma belief on v from conditionals given t, in units of a centre v0 (no cancellation):
    cond(t) = (E[v/v0 | t], E[log(v/v0) | t], Var[v | t]/v0²), mixed over logw.
    KL: match (E[v], E[log v]); moments: Var[v] = E[Var(v|t)] + Var(E[v|t]), summed centred."""
    lz, (m1, el) = qvec(logw, [lambda t: cond(t)[0], lambda t: cond(t)[1]], lo, hi, points)
    if projection == "kl":
        a = float(Gamma.project(np.array([m1, el])).shape_param)
        return lz, Gamma(a, a / (v0 * m1))
    _, (var,) = qvec(logw, [lambda t: (cond(t)[0] - m1) ** 2 + cond(t)[2]], lo, hi, points)
    return lz, Gamma(m1 * m1 / var, m1 / (v0 * var))


def rel_gaussian(q, mean, var):
    sd = np.sqrt(var)
    return max(abs(float(q.mean()) - mean) / max(abs(mean), sd), abs(float(q.var()) / var - 1.0))


def rel_gamma(q, ref):
    return max(abs(float(q.shape_param) / float(ref.shape_param) - 1), abs(float(q.rate) / float(ref.rate) - 1))


def around(c, scale, ks=(0, 0.3, 1, 2, 4, 8, 16, 32)):
    return [c + s * k * scale for k in ks for s in (-1, 1)]


# ------------------------------------------------------------------------------ product
PRODUCT_CASES = [
    # (m_x, v_x, m_y, v_y, m_z, v_z)
    (1.0, 1.0, 2.0, 1.0, 1.0, 1.0),
    (0.0, 1.0, 1.0, 1.0, 3.0, 0.1),          # x centred at 0, z far: bimodal in x
    (0.0, 1e-8, 1.0, 1.0, 0.0, 1.0),         # x centred at 0 and nearly a point mass
    (0.0, 1.0, 0.0, 1.0, 0.0, 1e-6),         # both inputs at 0, z ≈ 0 observed: spike at 0
    (0.0, 1.0, 0.0, 1.0, 0.0, 1e-12),        # the same, sharper: 1/|x| over 6 decades
    (2.0, 1e-10, 3.0, 1e-10, 6.0, 1e-6),     # nearly point masses
    (0.0, 100.0, 1.0, 1.0, 0.0, 1.0),        # very broad x
    (0.0, 1e4, 1.0, 1.0, 50.0, 0.01),        # very broad x, z pinned
    (3.0, 1.0, -2.0, 0.5, -6.0, 1e-4),
    (-1.0, 0.3, 0.0, 1e-6, 2.0, 4.0),        # y centred at 0 and narrow
]


def product_reference(mx, vx, my, vy, mz, vz):
    """Beliefs on x, z by the integral over y (and y by the integral over x)."""

    def over(m_other, v_other, m_int, v_int):  # integral over the input with message (m_int, v_int)
        def logw(t):
            V = t * t * v_other + vz
            return -0.5 * (t - m_int) ** 2 / v_int - 0.5 * np.log(V) - 0.5 * (t * m_other - mz) ** 2 / V

        sd, sc = np.sqrt(v_int), np.sqrt(vz / v_other)
        pts = around(m_int, sd) + [s * sc * 4.0**k for k in range(-2, 45) for s in (-1, 1)]
        lo, hi = m_int - 45 * sd, m_int + 45 * sd
        return logw, [p for p in pts if lo < p < hi], lo, hi

    logw, pts, lo, hi = over(mx, vx, my, vy)  # integral over y
    lz, ex, vxb = ref_gaussian_mixture(
        logw, lambda t: (mx * vz + mz * t * vx) / (t * t * vx + vz), lambda t: vx * vz / (t * t * vx + vz), lo, hi, pts
    )
    _, ez, vzb = ref_gaussian_mixture(
        logw, lambda t: (t * mx * vz + mz * t * t * vx) / (t * t * vx + vz),
        lambda t: t * t * vx * vz / (t * t * vx + vz), lo, hi, pts,
    )
    logw2, pts2, lo2, hi2 = over(my, vy, mx, vx)  # integral over x: y's posterior given x
    _, ey, vyb = ref_gaussian_mixture(
        logw2, lambda t: (my * vz + mz * t * vy) / (t * t * vy + vz), lambda t: vy * vz / (t * t * vy + vz), lo2, hi2, pts2
    )
    lz = lz - 0.5 * np.log(vy) - np.log(2 * np.pi)
    return lz, {"x": (ex, vxb), "y": (ey, vyb), "z": (ez, vzb)}


@pytest.mark.parametrize("case", PRODUCT_CASES)
def test_product_against_other_reduction(case):
    mx, vx, my, vy, mz, vz = case
    inc = {"x": Gaussian(mx, vx), "y": Gaussian(my, vy), "z": Gaussian(mz, vz)}
    lz, ref = product_reference(*case)
    for to in "xyz":
        q = product.belief(to, inc)
        assert isinstance(q, Gaussian) and q.shape == ()
        assert rel_gaussian(q, *ref[to]) <= TOL, (to, q, ref[to])
    assert abs(float(product.log_partition(inc)) - lz) <= TOL * max(1.0, abs(lz))


def test_product_batch_matches_rows_and_shape():
    cases = np.array(PRODUCT_CASES).T
    inc = {"x": Gaussian(cases[0], cases[1]), "y": Gaussian(cases[2], cases[3]), "z": Gaussian(cases[4], cases[5])}
    inc2 = {k: v.reshape(2, 5) for k, v in inc.items()}
    for to in "xyz":
        q = product.belief(to, inc2)
        assert q.shape == (2, 5)
        for i, row in enumerate(PRODUCT_CASES):
            one = product.belief(to, {k: Gaussian(row[2 * j], row[2 * j + 1]) for j, k in enumerate("xyz")})
            # equal to rounding (the geometric panels depend on the batch's widest row)
            assert rel_gaussian(q.reshape(-1)[i], float(one.mean()), float(one.var())) <= 1e-12
    assert product.log_partition(inc2).shape == (2, 5)
    # a scalar message broadcasts against a batch
    q = product.belief("z", {"x": Gaussian(np.zeros(3), 1.0), "y": Gaussian(1.0, 1.0), "z": Gaussian(0.0, 1.0)})
    assert q.shape == (3,)


# ------------------------------------------------------------------------------ gaussian
GAUSSIAN_CASES = [
    # (m_m, v_m, a, b, m_x, v_x, power)
    (0.0, 1.0, 2.0, 2.0, 1.0, 1.0, 1.0),
    (0.0, 1.0, 0.3, 0.5, 5.0, 0.1, 1.0),        # tau shape < 1
    (0.0, 1.0, 0.05, 0.01, 0.0, 1.0, 1.0),      # tau shape ≪ 1, very broad tau
    (3.0, 1e-6, 1e3, 1e3, -2.0, 1e-6, 1.0),     # nearly point-mass m and x
    (0.0, 1.0, 1e6, 1e6, 0.5, 1.0, 1.0),        # nearly point-mass tau
    (0.0, 100.0, 0.5, 1e-3, 0.0, 1.0, 1.0),     # broad m, broad tau
    (0.0, 1.0, 5.0, 1.0, 30.0, 1.0, 1.0),       # data far from the prior precision: bimodal in tau
    (1.0, 0.01, 0.1, 10.0, -1.0, 0.01, 1.0),
    (0.0, 1.0, 2.0, 2.0, 1.0, 1.0, 0.5),        # power EP
    (0.0, 1.0, 0.3, 0.5, 5.0, 0.1, 2.0),
]


def gaussian_reference(mm, vm, a, b, mx, vx, alpha, projection="kl"):
    """Integral over d = x − m: τ | d ~ Gamma(a + α/2, b + α d²/2), m | d Gaussian."""
    S, delta = vm + vx, mx - mm
    A = a + 0.5 * alpha

    def logw(d):  # −A log(b + αd²/2) − (d − Δ)²/(2S), the constant −A log b dropped
        return -A * np.log1p(0.5 * alpha * d * d / b) - 0.5 * (d - delta) ** 2 / S

    sd, sc = np.sqrt(S), np.sqrt(b / A / alpha)
    pts = around(delta, sd) + around(0.0, sc, ks=(0, 0.3, 1, 3, 10, 30, 100, 1e3, 1e4))
    lo, hi = delta - 45 * sd, delta + 45 * sd
    dig = special.digamma(A) - np.log(A)

    def cond(d):  # τ0 = A / b;  τ/τ0 | d has mean 1/(1+ρ), ρ = αd²/(2b)
        k = 1.0 / (1.0 + 0.5 * alpha * d * d / b)
        return k, dig + np.log(k), k * k / A

    lz, qt = ref_gamma(logw, cond, lo, hi, pts, A / b, projection)
    mpost = lambda d: (mm * vx + (mx - d) * vm) / S  # noqa: E731
    _, em, vmb = ref_gaussian_mixture(logw, mpost, lambda d: vm * vx / S, lo, hi, pts)
    _, ex, vxb = ref_gaussian_mixture(logw, lambda d: mpost(d) + d, lambda d: vm * vx / S, lo, hi, pts)
    # constants: Gamma normaliser, Γ(a+α/2)/Γ(a) b^{−A}, (2π)^{-α/2} of f^α, N(d; Δ, S) normaliser
    lz = (
        lz + a * np.log(b) - A * np.log(b) + special.gammaln(A) - special.gammaln(a)
        - 0.5 * alpha * np.log(2 * np.pi) - 0.5 * np.log(2 * np.pi * S)
    )
    return lz, {"tau": qt, "m": (em, vmb), "x": (ex, vxb)}


@pytest.mark.parametrize("case", GAUSSIAN_CASES)
def test_gaussian_against_other_reduction(case):
    mm, vm, a, b, mx, vx, alpha = case
    inc = {"m": Gaussian(mm, vm), "tau": Gamma(a, b), "x": Gaussian(mx, vx)}
    lz, ref = gaussian_reference(*case)
    for to in ("m", "x"):
        q = gaussian.belief(to, inc, power=alpha)
        assert isinstance(q, Gaussian)
        assert rel_gaussian(q, *ref[to]) <= TOL, (to, q, ref[to])
    q = gaussian.belief("tau", inc, power=alpha)
    assert isinstance(q, Gamma)
    assert rel_gamma(q, ref["tau"]) <= TOL, (q, ref["tau"])
    got = float(gaussian.log_partition(inc, power=alpha))
    assert abs(got - lz) <= TOL * max(1.0, abs(lz))


@pytest.mark.parametrize("case", [GAUSSIAN_CASES[1], GAUSSIAN_CASES[4], GAUSSIAN_CASES[6]])
def test_gaussian_tau_moment_matching(case):
    mm, vm, a, b, mx, vx, alpha = case
    inc = {"m": Gaussian(mm, vm), "tau": Gamma(a, b), "x": Gaussian(mx, vx)}
    _, ref = gaussian_reference(*case, projection="moments")
    q = gaussian.belief("tau", inc, projection="moments", power=alpha)
    assert rel_gamma(q, ref["tau"]) <= TOL, (q, ref["tau"])


# ------------------------------------------------------------------------------ gamma_rate
GAMMA_RATE_CASES = [
    # (a_r, b_r, a_x, b_x, shape, power)
    (3.0, 4.0, 5.0, 6.0, 2.5, 1.0),
    (0.5, 1.0, 2.0, 3.0, 0.3, 1.0),        # shape < 1
    (1.0, 1.0, 0.8, 0.1, 0.4, 1.0),        # shape < 1 and x shape < 1 (c = 0.2)
    (100.0, 10.0, 1.0, 1.0, 1.0, 1.0),
    (1e6, 1e6, 2.0, 1.0, 1.0, 1.0),        # nearly point-mass r
    (2.0, 1.0, 1e6, 1e5, 0.5, 1.0),        # nearly point-mass x
    (0.05, 0.01, 0.5, 0.01, 3.0, 1.0),     # very broad r and x
    (3.0, 4.0, 5.0, 6.0, 2.5, 0.5),        # power EP
    (0.5, 1.0, 2.0, 3.0, 0.8, 3.0),
]


def _range(A, mode, sd):
    """Integration range and points in u = log v about the mode: the left tail falls like e^{A u}
    (far for small A); for large A the density is ≈ Gaussian in u."""
    left = 80.0 / A + 60.0 if A <= 10 else 60.0 * sd
    lo, hi = mode - left, mode + min(60.0, 60.0 * sd + 5.0)
    pts = around(mode, sd) + [mode - k for k in (1, 3, 10, 30, 100, 300, 1e3, 3e3)]
    return lo, hi, pts


def _mode_u(dfun, lo=-300.0, hi=300.0):
    from scipy.optimize import brentq

    return brentq(dfun, lo, hi, xtol=1e-14)


def _conj_reduction(A, B, C, K, alpha, Apost, projection):
    """∫ e^{A u − B e^u − C log(K + α e^u)} du in centred form about its mode u0, and the Gamma
    belief of the *other* variable v | u ~ Gamma(Apost, K + α e^u) mixed over it."""
    u0 = _mode_u(lambda u: A - B * np.exp(u) - C * special.expit(u + np.log(alpha / K)))
    e0 = np.exp(u0)
    K0 = K + alpha * e0

    def rho(d):  # (K + α e^{u0+d}) / K0 − 1
        return alpha * e0 * np.expm1(d) / K0

    def logw(d):
        return A * d - B * e0 * np.expm1(d) - C * np.log1p(rho(d))

    dig = special.digamma(Apost) - np.log(Apost)

    def cond(d):  # v0 = Apost / K0
        k = 1.0 / (1.0 + rho(d))
        return k, dig + np.log(k), k * k / Apost

    sd = 1.0 / np.sqrt(A + B * e0)
    lo, hi, pts = _range(A, 0.0, sd)
    lz, q = ref_gamma(logw, cond, lo, hi, pts, Apost / K0, projection)
    return lz + A * u0 - B * e0 - C * np.log(K0), q


def gamma_rate_reference(ar, br, ax, bx, s, alpha, projection="kl"):
    c = alpha * (s - 1.0) + ax
    Ar = alpha * s + ar
    # belief on r through the integral over x (u = log x, Jacobian included):
    # w(x) ∝ x^{c−1} e^{−b_x x} (b_r + αx)^{−Ar},  r | x ~ Gamma(Ar, b_r + αx)
    lz, qr = _conj_reduction(c, bx, Ar, br, alpha, Ar, projection)
    lz = (
        lz + ar * np.log(br) + ax * np.log(bx) + special.gammaln(Ar)
        - special.gammaln(ar) - special.gammaln(ax) - alpha * special.gammaln(s)
    )
    # belief on x through the integral over r: w(r) ∝ r^{Ar−1} e^{−b_r r} (αr + b_x)^{−c}, x | r ~ Gamma(c, αr + b_x)
    _, qx = _conj_reduction(Ar, br, c, bx, alpha, c, projection)
    return lz, {"r": qr, "x": qx}


@pytest.mark.parametrize("case", GAMMA_RATE_CASES)
@pytest.mark.parametrize("projection", ["kl", "moments"])
def test_gamma_rate_against_other_reduction(case, projection):
    ar, br, ax, bx, s, alpha = case
    inc = {"r": Gamma(ar, br), "x": Gamma(ax, bx)}
    lz, ref = gamma_rate_reference(*case, projection=projection)
    for to in ("r", "x"):
        q = gamma_rate.belief(to, inc, projection=projection, power=alpha, shape=s)
        assert isinstance(q, Gamma)
        assert rel_gamma(q, ref[to]) <= TOL, (to, q, ref[to])
    got = float(gamma_rate.log_partition(inc, power=alpha, shape=s))
    assert abs(got - lz) <= TOL * max(1.0, abs(lz))


def test_gamma_rate_infer_net_case():
    """Infer.NET's GammaFromShapeAndRate test: shape 2.5, rate ~ Gamma(3, rate 4), x constrained to
    Gamma(5, rate 6).  Moment matching (Infer.NET's convention) gives x Gamma(6.298, scale 0.1455)
    and rate Gamma(5.325, scale 0.2112) (its tolerance 1e-3); the KL projection differs."""
    inc = {"r": Gamma(3.0, 4.0), "x": Gamma(5.0, 6.0)}
    qx = gamma_rate.belief("x", inc, projection="moments", shape=2.5)
    qr = gamma_rate.belief("r", inc, projection="moments", shape=2.5)
    np.testing.assert_allclose([qx.shape_param, 1 / qx.rate], [6.298, 0.1455], rtol=1e-3)
    np.testing.assert_allclose([qr.shape_param, 1 / qr.rate], [5.325, 0.2112], rtol=1e-3)
    kx = gamma_rate.belief("x", inc, shape=2.5)
    kr = gamma_rate.belief("r", inc, shape=2.5)
    np.testing.assert_allclose([kx.shape_param, kr.shape_param], [6.328, 5.356], atol=1e-3)
    # the two projections share the mean and differ in shape
    np.testing.assert_allclose(kx.mean(), qx.mean(), rtol=1e-12)
    assert abs(float(kx.shape_param) - float(qx.shape_param)) > 0.02


def test_gamma_rate_improper_tilted_is_an_oracle_error_naming_rows():
    # c = shape − 1 + a_x = 0.3 − 1 + 0.5 < 0: x^(c−1) is not integrable at 0
    inc = {"r": Gamma(np.ones(3), 1.0), "x": Gamma(np.array([2.0, 0.5, 2.0]), 1.0)}
    with pytest.raises(OracleError, match=r"rows \[1\]"):
        gamma_rate.belief("r", inc, shape=0.3)
    with pytest.raises(OracleError, match="improper"):
        gamma_rate.log_partition(inc, shape=0.3)


# ------------------------------------------------------------------------------ exp
EXP_CASES = [
    # (m, v, a, b)
    (0.0, 1.0, 1.0, 1.0),
    (1.0, 100.0, 2.0, 0.1),          # x-variance 100
    (-2.0, 100.0, 3.0, 1e-3),        # x-variance 100, broad y
    (2.0, 100.0, 1.0, 1e-8),         # x-variance 100, very broad y
    (0.5, 30.0, 0.05, 0.01),         # y shape ≪ 1
    (3.0, 1e-6, 2.0, 1.0),           # nearly point-mass x (belief on y: shape ≈ 1e6)
    (0.0, 1.0, 1e6, 1e6),            # nearly point-mass y
    (-5.0, 4.0, 0.5, 50.0),
]


def exp_reference(m, v, a, b, projection="kl"):
    from scipy.optimize import brentq

    c = m + v * (a - 1.0)
    with np.errstate(over="ignore"):
        x0 = brentq(lambda x: (c - x) / v - b * np.exp(x), c - np.logaddexp(0, np.log(v * b) + c) - 1, c + 1, xtol=1e-15)
    y0 = np.exp(x0)

    def logw(d):  # log w(x0 + d) − log w(x0)
        with np.errstate(over="ignore"):
            return -(d * d + 2.0 * d * (x0 - m)) / (2.0 * v) + (a - 1.0) * d - b * y0 * np.expm1(d)

    sd = 1.0 / np.sqrt(1.0 / v + b * y0)
    lo, hi = -45.0 * np.sqrt(v) - 45.0 * sd, 45.0 * sd + 2.0 * np.sqrt(v)
    pts = around(0.0, sd) + around(0.0, np.sqrt(v))
    lz, ex, vx = ref_gaussian_mixture(logw, lambda d: d, lambda d: 0.0, lo, hi, pts)
    lz, qy = ref_gamma(logw, lambda d: (np.exp(d), d, 0.0), lo, hi, pts, y0, projection)
    lz = lz - 0.5 * (x0 - m) ** 2 / v + (a - 1.0) * x0 - b * y0
    lz = lz - 0.5 * np.log(2 * np.pi * v) + a * np.log(b) - special.gammaln(a)
    return lz, {"x": (x0 + ex, vx), "y": qy}


@pytest.mark.parametrize("case", EXP_CASES)
@pytest.mark.parametrize("projection", ["kl", "moments"])
def test_exp_against_quad_vec(case, projection):
    m, v, a, b = case
    inc = {"x": Gaussian(m, v), "y": Gamma(a, b)}
    lz, ref = exp_reference(*case, projection=projection)
    qx = exp.belief("x", inc, projection=projection)
    assert rel_gaussian(qx, *ref["x"]) <= TOL, (qx, ref["x"])
    qy = exp.belief("y", inc, projection=projection)
    assert rel_gamma(qy, ref["y"]) <= TOL, (qy, ref["y"])
    assert abs(float(exp.log_partition(inc)) - lz) <= TOL * max(1.0, abs(lz))


# ------------------------------------------------------------------------------ Monte Carlo, samplers
MC_CASES = [
    ("product", {"x": Gaussian(0.5, 1.0), "y": Gaussian(1.0, 0.5), "z": Gaussian(0.5, 1.0)}, {}),
    ("gaussian", {"m": Gaussian(0.0, 1.0), "tau": Gamma(0.7, 0.5), "x": Gaussian(1.0, 0.5)}, {}),
    ("gamma_rate", {"r": Gamma(3.0, 2.0), "x": Gamma(2.0, 1.5)}, {"shape": 0.7}),
    ("exp", {"x": Gaussian(0.0, 2.0), "y": Gamma(2.0, 1.0)}, {}),
]


@pytest.mark.parametrize("name,inc,params", MC_CASES, ids=[c[0] for c in MC_CASES])
def test_log_partition_and_output_mean_by_direct_monte_carlo(name, inc, params):
    """Z = E[m_out(out)] over inputs drawn from their messages and the output from the module's
    sampler; the output's tilted mean E[out m_out(out)] / Z likewise.  Within 5 standard errors."""
    mod = FACTORS[name]
    rng = np.random.default_rng(7)
    n = 400_000
    ins = {v: inc[v].sample(n, rng)[:, ] for v in mod.INPUTS}
    out = mod.sample(ins, n, rng, **params)
    w = np.exp(inc[mod.OUTPUT].log_pdf(out))
    z_mc, z_se = w.mean(), w.std() / np.sqrt(n)
    z = float(np.exp(mod.log_partition(inc, **params)))
    assert abs(z - z_mc) <= 5 * z_se
    mean_mc = np.sum(w * out) / np.sum(w)
    resid = (out - mean_mc) * w / w.mean()
    se = resid.std() / np.sqrt(n)
    q = mod.belief(mod.OUTPUT, inc, **params)
    assert abs(float(q.mean()) - mean_mc) <= 5 * se


def test_samplers_shapes_and_validation():
    rng = np.random.default_rng(0)
    assert product.sample({"x": np.ones(4), "y": np.arange(4.0)}, 4, rng).tolist() == [0, 1, 2, 3]
    assert exp.sample({"x": np.zeros(3)}, 3, rng).tolist() == [1, 1, 1]
    x = gaussian.sample({"m": 2.0, "tau": 1e12}, 5, rng)
    assert x.shape == (5,) and np.allclose(x, 2.0, atol=1e-4)
    g = gamma_rate.sample({"r": np.full(200_000, 2.0)}, 200_000, rng, shape=3.0)
    assert abs(g.mean() - 1.5) < 5 * np.sqrt(3.0 / 4.0 / 200_000)
    with pytest.raises(ValueError, match="'y'"):
        product.sample({"x": np.ones(2)}, 2, rng)
    with pytest.raises(ValueError, match="tau"):
        gaussian.sample({"m": np.zeros(2), "tau": np.array([1.0, -1.0])}, 2, rng)
    with pytest.raises(ValueError, match="'r'"):
        gamma_rate.sample({"r": np.array([np.nan])}, 1, rng)
    with pytest.raises(ValueError, match="shape"):
        gamma_rate.sample({"r": np.ones(1)}, 1, rng, shape=0.0)


# ------------------------------------------------------------------------------ power EP
@pytest.mark.parametrize("mod,inc", [
    (product, {"x": Gaussian(0.0, 1.0), "y": Gaussian(1.0, 1.0), "z": Gaussian(0.0, 1.0)}),
    (exp, {"x": Gaussian(0.0, 1.0), "y": Gamma(1.0, 1.0)}),
])
def test_power_refused_for_deterministic_factors(mod, inc):
    assert not mod.SUPPORTS_POWER
    with pytest.raises(NotImplementedError, match="not a density"):
        mod.belief(mod.OUTPUT, inc, power=0.5)
    with pytest.raises(NotImplementedError, match="deterministic"):
        mod.log_partition(inc, power=2.0)
    assert mod.belief(mod.OUTPUT, inc, power=1.0).allclose(mod.belief(mod.OUTPUT, inc), rtol=0)


def test_power_tends_to_cavity_as_power_goes_to_zero():
    inc = {"m": Gaussian(0.3, 1.0), "tau": Gamma(2.0, 3.0), "x": Gaussian(1.0, 2.0)}
    for v in ("m", "tau", "x"):
        q = gaussian.belief(v, inc, power=1e-7)
        assert q.allclose(inc[v], rtol=1e-5)
    inc = {"r": Gamma(2.0, 3.0), "x": Gamma(4.0, 2.0)}
    for v in ("r", "x"):
        assert gamma_rate.belief(v, inc, power=1e-7, shape=2.0).allclose(inc[v], rtol=1e-5)


# ------------------------------------------------------------------------------ bad input
ALL = [
    (product, {"x": Gaussian(0.0, 1.0), "y": Gaussian(1.0, 1.0), "z": Gaussian(0.0, 1.0)}),
    (gaussian, {"m": Gaussian(0.0, 1.0), "tau": Gamma(2.0, 1.0), "x": Gaussian(0.0, 1.0)}),
    (gamma_rate, {"r": Gamma(2.0, 1.0), "x": Gamma(2.0, 1.0)}),
    (exp, {"x": Gaussian(0.0, 1.0), "y": Gamma(2.0, 1.0)}),
]


def _bad_messages(fam):
    if fam is Gaussian:
        return [
            (Gaussian._unchecked(np.array([0.0, np.nan]), 1.0), "non-finite"),
            (Gaussian.from_natural(np.array([[1.0, 0.5]])), "improper"),   # negative precision
            (Gaussian._unchecked(0.0, -1.0), "improper"),
            (Gamma(1.0, 1.0), "must be a Gaussian"),
        ]
    return [
        (Gamma._unchecked(np.array([1.0, np.nan]), 1.0), "non-finite"),
        (Gamma._unchecked(0.0, 1.0), "improper"),
        (Gamma._unchecked(-1.0, 1.0), "improper"),
        (Gamma._unchecked(1.0, -2.0), "improper"),
        (Beta(1.0, 1.0), "must be a Gamma"),
    ]


@pytest.mark.parametrize("mod,inc", ALL, ids=[m.NAME for m, _ in ALL])
def test_bad_input_is_a_value_error_naming_the_variable(mod, inc):
    for var, fam in mod.FAMILIES.items():
        for bad, what in _bad_messages(fam):
            broken = {**inc, var: bad}
            for call in (lambda: mod.belief(mod.OUTPUT, broken), lambda: mod.log_partition(broken)):
                with pytest.raises(ValueError, match=what) as err:
                    call()
                assert f"'{var}'" in str(err.value)
        missing = {k: v for k, v in inc.items() if k != var}
        with pytest.raises(ValueError, match=f"'{var}'"):
            mod.belief(mod.OUTPUT, missing)
    with pytest.raises(ValueError, match="'w'"):
        mod.belief(mod.OUTPUT, {**inc, "w": Gaussian(0.0, 1.0)})
    with pytest.raises(ValueError, match="`to`='nope'"):
        mod.belief("nope", inc)
    with pytest.raises(ValueError, match="projection"):
        mod.belief(mod.OUTPUT, inc, projection="ep")
    with pytest.raises(ValueError, match="power"):
        mod.belief(mod.OUTPUT, inc, power=-1.0)
    with pytest.raises(ValueError, match="power"):
        mod.belief(mod.OUTPUT, inc, power=np.nan)
    with pytest.raises(ValueError, match="mapping"):
        mod.belief(mod.OUTPUT, [1, 2])
    first = next(iter(mod.FAMILIES))
    shaped = {**inc, first: inc[first].broadcast_to((3,))}
    other = [v for v in mod.FAMILIES if v != first][0]
    shaped[other] = inc[other].broadcast_to((2,))
    with pytest.raises(ValueError, match="do not broadcast"):
        mod.belief(mod.OUTPUT, shaped)


def test_gamma_rate_shape_parameter_is_validated():
    inc = ALL[2][1]
    for bad in (0.0, -1.0, np.nan, np.inf, "a"):
        with pytest.raises(ValueError, match="`shape`"):
            gamma_rate.belief("x", inc, shape=bad)


def test_module_metadata():
    assert set(FACTORS) == {"product", "gaussian", "gamma_rate", "exp"}
    assert product.INPUTS == ("x", "y") and product.OUTPUT == "z"
    assert gaussian.INPUTS == ("m", "tau") and gaussian.OUTPUT == "x"
    assert gamma_rate.INPUTS == ("r",) and gamma_rate.OUTPUT == "x" and gamma_rate.PARAMS == {"shape": 1.0}
    assert exp.INPUTS == ("x",) and exp.OUTPUT == "y"
    assert gaussian.FAMILIES == {"m": Gaussian, "tau": Gamma, "x": Gaussian}
    assert exp.FAMILIES == {"x": Gaussian, "y": Gamma}
