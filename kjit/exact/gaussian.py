"""Exact EP rules of the ``gaussian`` factor: m (Gaussian), tau (Gamma) → x ~ N(m, 1/tau) (Gaussian).

Incoming N(m; m_m, v_m), Gamma(tau; a, b), N(x; m_x, v_x); power α (α = 1 is EP).  The powered
factor N(x; m, 1/τ)^α = (2π)^{(1−α)/2} α^{−1/2} τ^{(α−1)/2} N(x; m, 1/(ατ)) is again Gaussian
given τ, so m and x integrate out in closed form and everything is a 1-D integral over τ,
done in u = log τ:

    w(τ) ∝ Gamma(τ; a, b) τ^{(α−1)/2} N(m_x; m_m, S + q),   S = v_m + v_x,  q = 1/(ατ),
    log w(u) = a' u − b e^u − ½ log(S + q) − D / (2 (S + q)) + const,  a' = a + (α−1)/2,
    D = (m_x − m_m)².

w can have two modes (a tau message far from the precision the data ask for).  Its stationary
points are the positive roots of the cubic 2(a' − bτ)(1 + Sατ)² + (1 + Sατ) − Dατ = 0 (the
derivative times 2(1 + Sατ)²), all inside [log((a'+½)/(b + Sα/2 + Dα/2)), log((a'+½)/b)]
where the derivative's sign is known; they are located from the companion-matrix eigenvalues
and refined by bisection on sign changes, then serve as the panel rule's break points.

* belief on tau: Gamma, KL projection (E[τ], E[log τ]) or ``projection="moments"`` (mean,
  variance; Infer.NET's convention for a Gaussian's precision).  E[τ^k] is the same integral
  with a → a + k (its own panels when w is broad);
* beliefs on x and m: w-mixtures of the Gaussian posteriors given τ, e.g. for x
  N(m_x + (m_m − m_x) v_x h, v_x (v_m + q) h) with h = 1/(S + q) — bounded functions of τ;
  mixture moments E[var] + Var[mean], summed centred;
* ``log_partition``: log ∫ f^α Π incoming.

Power EP is supported for every direction (any α > 0; the left tail of w behaves like
τ^{a + α/2 − 1}, integrable for all a > 0).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from scipy import special

from ..families import Family, Gamma, Gaussian
from ._common import (
    check_incoming,
    check_power,
    check_projection,
    check_sample_inputs,
    check_to,
    col,
    empty_belief,
    gamma_belief,
    gamma_exponent,
    gamma_normaliser,
    gamma_shift,
    gaussian_belief,
    gaussian_mixture,
    is_empty,
    log_gamma_ratio,
    rule,
    stationary_points,
)

NAME = "gaussian"
INPUTS = ("m", "tau")
OUTPUT = "x"
FAMILIES = {"m": Gaussian, "tau": Gamma, "x": Gaussian}
PARAMS: dict = {}
SUPPORTS_POWER = True

__all__ = ["belief", "log_partition", "sample", "log_weight", "stationary_candidates", "curvature_scale",
           "node_moments"]


def log_weight(t, a, extra, u0, log_s, d, log_alpha):
    """log w(u) at nodes ``t``: the message's exponent less its value at the mode (:func:`gamma_shift`'s
    u₀ and c; :func:`~kjit.exact._common.gamma_exponent`) + e·u − ½ log(S + q) − D/(2(S + q)),
    q = e^{−u}/α — parameters given aligned with ``t`` (columns, or per-node arrays): a, e = ``extra``,
    u₀, log S, D, log α.  The exact rule's integrand and the reference's
    (:meth:`kjit.factors.gaussian.GaussianFactor.approximate_belief`)."""
    with np.errstate(over="ignore"):
        lsq = np.logaddexp(log_s, -t - log_alpha)  # log(S + q)
        return gamma_exponent(t, a, u0, extra) - 0.5 * lsq - 0.5 * d * np.exp(-lsq)


def stationary_candidates(ap, b, S, D, alpha, reversed_too: bool = False):
    """``(candidates (B, K), real (B, K), lo, hi)``: log τ of the positive real parts of the cubic's roots
    c3 τ³ + c2 τ² + c1 τ + c0 (the derivative of log w times 2(1 + Sατ)², a' = ``ap``; companion-matrix
    eigenvalues in ξ = Sατ) — approximately every stationary point of w, NaN for none or where the
    coefficients are not finite — which of them are real (those are stationary points themselves), and the
    bracket [lo, hi] in u outside which the derivative's sign is known.  The eigenvalues are accurate relative to
    the largest root: a root many decades smaller is lost (D ~5e18 puts w's one mode at τ ~1e-19 where the others
    are ~1e9).  K = 3, or with ``reversed_too`` 6: also the reciprocals of the reversed cubic's roots, accurate
    for the smallest (the exact rule and the reference take them: without them the exact rule's sign changes
    cancelled between candidates and it integrated the wrong mode, 60-digit mpmath, forty-seventh session)."""
    # the cubic in τ: c3 τ³ + c2 τ² + c1 τ + c0, p = Sα
    p = S * alpha
    c3 = -2.0 * b * p * p
    c2 = 2.0 * ap * p * p - 4.0 * b * p
    c1 = 4.0 * ap * p - 2.0 * b + p - D * alpha
    c0 = 2.0 * ap + 1.0
    # roots in the scaled variable ξ = pτ (coefficients of order a', b/p, D/S): companion matrix
    k3, k2, k1, k0 = c3 / p**3, c2 / p**2, c1 / p, c0
    xi, ok = _cubic_roots(k3, k2, k1, k0)
    re = xi.real
    with np.errstate(divide="ignore", invalid="ignore"):
        cand = np.where((re > 0) & ok[:, None], np.log(np.where(re > 0, re, 1.0)) - np.log(p)[:, None], np.nan)
    # the derivative is < 0 above τ = (a'+½)/b and > 0 below (a'+½)/(b + p/2 + Dα/2); the margin
    # of 1 keeps the end signs clear of rounding when the two bounds nearly coincide (S tiny)
    hi = np.log((ap + 0.5) / b) + 1.0
    lo = np.log(ap + 0.5) - np.log(b + 0.5 * p + 0.5 * D * alpha) - 1.0
    real = np.abs(xi.imag) <= 1e-6 * np.abs(xi)  # real eigenvalues are stationary points themselves
    if reversed_too:
        # η = 1/ξ: k0 η³ + k1 η² + k2 η + k3 (k0 = 2a' + 1 > 0)
        eta, ok_r = _cubic_roots(k0, k1, k2, k3)
        with np.errstate(divide="ignore", invalid="ignore"):
            re_xi = np.reciprocal(eta).real  # Re(1/η) (complex division scales: |η|² overflows from |η| ~1e154)
            cand_r = np.where((re_xi > 0) & np.isfinite(re_xi) & ok_r[:, None],
                              np.log(np.where(re_xi > 0, re_xi, 1.0)) - np.log(p)[:, None], np.nan)
        cand = np.concatenate([cand, cand_r], axis=1)
        real = np.concatenate([real, np.abs(eta.imag) <= 1e-6 * np.abs(eta)], axis=1)
    return cand, real, lo, hi


def _cubic_roots(k3, k2, k1, k0):
    """``(roots (B, 3) complex, ok (B,))``: the eigenvalues of the companion matrix of k3 x³ + k2 x² + k1 x + k0,
    per row; ``ok`` False (roots of a zero matrix) where its monic coefficients are not finite."""
    B = len(k3)
    comp = np.zeros((B, 3, 3))
    comp[:, 0, :] = -np.stack([k2, k1, k0], axis=1) / k3[:, None]
    comp[:, 1, 0] = 1.0
    comp[:, 2, 1] = 1.0
    ok = np.all(np.isfinite(comp.reshape(B, -1)), axis=1)
    comp[~ok] = 0.0
    return np.linalg.eigvals(comp), ok


def curvature_scale(u, b, S, D, alpha):
    """A local scale 1/√κ of w about the points ``u`` (parameters aligned with them): κ = bτ + ½pτg² +
    ½Dατg³|1 − pτ|, τ = e^u, p = Sα, g = 1/(1 + pτ) — of the order of −(log w)'' (the panel rule's step at
    the highest stationary point; the reference's nodes where the curvature is not negative)."""
    p = S * alpha
    tau = np.exp(u)
    g = 1.0 / (1.0 + p * tau)
    curv = b * tau + 0.5 * p * tau * g * g + 0.5 * D * alpha * tau * g**3 * np.abs(1.0 - p * tau)
    return 1.0 / np.sqrt(np.maximum(curv, 1e-300))


def node_moments(u, to, mm, vm, mx, vx, S, alpha):
    """Mean and variance of ``to``'s (x or m) Gaussian posterior given τ = e^u at nodes ``u``, the
    messages' parameters aligned with them: x ~ N(m_x + (m_m − m_x) v_x h, v_x (v_m h + q h)),
    h = 1/(S + q), q = e^{−u}/α (m alike, exchanged) — formed without overflow for τ → 0."""
    logS = np.log(S)
    lq = -u - np.log(alpha)
    with np.errstate(over="ignore", under="ignore"):
        h = np.exp(-np.logaddexp(logS, lq))
        qh = special.expit(lq - logS)
    if to == "x":
        return mx + (mm - mx) * vx * h, vx * (vm * h + qh)
    return mm + (mx - mm) * vm * h, vm * (vx * h + qh)


def _rule(a, extra, b, S, D, alpha):
    """Panel rule in u = log τ for exp(a u − b e^u − c + e·u − ½ log(S + q) − D/(2(S + q))),
    q = e^{−u}/α, e = ``extra`` (the power's (α−1)/2, plus a moment's k), c the message's exponent
    at its mode (:func:`~kjit.exact._common.gamma_shift`; its normaliser with c given back is
    :func:`~kjit.exact._common.gamma_normaliser`).  Returns (u, lw, raw log integral)."""
    logb, logS, la = np.log(b), np.log(S), np.log(alpha)
    u0 = gamma_shift(a, b)
    ap = a + extra  # (for the stationary points only: a + e need not be exact there)

    def logf(t, rows=None):
        aa, ee, ls, dd, uu = (col(p, t, rows) for p in (a, extra + np.zeros_like(a), logS, D, u0))
        return log_weight(t, aa, ee, uu, ls, dd, la)

    def dlogf(t, rows=None):
        aa, lb, ls, dd = (col(p, t, rows) for p in (ap, logb, logS, D))
        with np.errstate(over="ignore"):
            lt = t + la + ls  # log(pτ), p = Sα
            g = special.expit(-lt)  # 1/(1 + pτ)
            # Dατ g² / 2 = D/(2S) · pτ g²
            return aa - np.exp(t + lb) + 0.5 * g - 0.5 * dd / np.exp(ls) * special.expit(lt) * g

    B = len(ap)
    cand, real, lo, hi = stationary_candidates(ap, b, S, D, alpha, reversed_too=True)
    roots = stationary_points(dlogf, cand, lo, hi, accept=real)
    # step: the local scale at the highest stationary point
    with np.errstate(invalid="ignore"):
        vals = np.where(np.isfinite(roots), logf(np.where(np.isfinite(roots), roots, lo[:, None])), -np.inf)
    best = roots[np.arange(B), np.argmax(vals, axis=1)]
    step = curvature_scale(best, b, S, D, alpha)
    step = np.minimum(step, np.maximum(hi - lo, 1.0))
    return rule(NAME, logf, roots, step)


def _log_moment_rule(a, extra, b, S, D, alpha, lz0):
    """k ↦ log E[τ^k] under the tilted distribution: the raw integral with τ^k added, less the
    integral without it (the same shift in both)."""
    def log_moment(k):
        return _rule(a, extra + k, b, S, D, alpha)[2] - lz0
    return log_moment


def _setup(incoming, power):
    alpha = check_power(power)
    flat, shape = check_incoming(NAME, FAMILIES, incoming)
    mm, vm = flat["m"].mean(), flat["m"].var()
    a, b = flat["tau"].shape_param, flat["tau"].rate
    mx, vx = flat["x"].mean(), flat["x"].var()
    S = vm + vx
    D = (mx - mm) ** 2
    ap = a + 0.5 * (alpha - 1.0)
    return alpha, flat, shape, (mm, vm, a, b, mx, vx, S, D, ap)


def belief(to: str, incoming: Mapping[str, Family], projection: str = "kl", power: float = 1.0) -> Family:
    """Projected belief on ``to`` in {"m", "tau", "x"} for the factor to the power ``power``.

    Gaussian beliefs (m, x) by their first two moments; the Gamma belief on tau by the KL
    projection or, with ``projection="moments"``, by mean and variance.
    """
    check_to(NAME, tuple(FAMILIES), to)
    check_projection(projection)
    alpha, flat, shape, (mm, vm, a, b, mx, vx, S, D, ap) = _setup(incoming, power)
    if is_empty(shape):
        return empty_belief(FAMILIES[to], shape)
    known, a_r, b_r = _known_precision(a, b)
    extra = 0.5 * (alpha - 1.0)
    if known.any():
        a_k, b_k, _ = _narrow_tau(a, b, S, D, alpha)
    if to == "tau":
        if known.all():
            return Gamma(a_k, b_k).reshape(shape)
        u, lw, lz0 = _rule(a_r, extra, b_r, S, D, alpha)
        q = gamma_belief(NAME, u, lw, _log_moment_rule(a_r, extra, b_r, S, D, alpha, lz0), projection)
        if known.any():
            q = Gamma(np.where(known, a_k, q.shape_param), np.where(known, b_k, q.rate))
        return q.reshape(shape)
    if known.all():
        u, lw = np.log(a_k / b_k)[:, None], np.zeros((len(a), 1))
    else:
        u, lw, _ = _rule(a_r, extra, b_r, S, D, alpha)
        if known.any():  # one node at the tilted τ's mean, weight 1
            u = np.where(known[:, None], np.log(a_k / b_k)[:, None], u)
            lw = np.where(known[:, None], np.where(np.arange(u.shape[1]) == 0, 0.0, -np.inf), lw)
    # the posterior of x (or m) given τ at the nodes, without overflow for τ → 0
    mu, var = node_moments(u, to, *(p[:, None] for p in (mm, vm, mx, vx, S)), alpha)
    mean, v = gaussian_mixture(lw, mu, var)
    return gaussian_belief(NAME, mean, v).reshape(shape)


#: a τ message of a larger shape is narrower than the rule's nodes — a few ulp of log τ₀ apart at
#: best — resolve (measured at τ₀ = 0.5, power 0.5: evidence errors 3e-10 at shape 1e16, 2e-8 at
#: 1e20, 2e-6 at 1e24; found in review: 2.6e18 nats off at 1e40): :func:`_narrow_tau` answers it
KNOWN_PRECISION_SHAPE = 1e14


def _narrow_tau(a, b, S, D, alpha):
    """The tilted τ of a τ message narrower than the rule resolves, by τ's powers exactly and the rest
    of the likelihood to first order about τ₀ = a/b: the likelihood is τ^{α/2} e^{h(τ)}·const with
    h(τ) = −½ ln(1 + Sατ) − Dατ / (2(1 + Sατ)) (exact when S = 0), so the tilted τ is
    Gamma(a + α/2, b − h'(τ₀)); its terms beyond the first order are O(1/a) of the first (found in
    review: the message returned unchanged was 12 nats off where D τ₀ ~ 1e8).  Returns (shape,
    rate, log E[(τ/τ₀)^{α/2} e^{h(τ) − h(τ₀)}] — the evidence's factor beyond L(τ₀))."""
    t0 = a / b
    w = 1.0 + S * alpha * t0
    g1 = -0.5 * S * alpha / w - 0.5 * D * alpha / (w * w)  # h'(τ₀) ≤ 0
    shape, rate = a + 0.5 * alpha, b - g1
    # log E_Gamma(a,b)[(τ/τ₀)^{α/2} e^{g1(τ − τ₀)}] = −g1 τ₀ − (a + α/2) ln(1 + y) + lnΓ(a + α/2) − lnΓ(a)
    # − (α/2) ln a, y = −g1/b: the first two, each ~a y, as a (y − ln(1 + y)) − (α/2) ln(1 + y)
    y = -g1 / b
    log_e = a * _y_minus_log1p(y) - 0.5 * alpha * np.log1p(y) \
        + log_gamma_ratio(a, 0.5 * alpha + np.zeros_like(a)) - 0.5 * alpha * np.log(a)
    return shape, rate, log_e


def _y_minus_log1p(y):
    """y − ln(1 + y) for y ≥ 0, by its series y²/2 − y³/3 + … below 0.05 (where the difference cancels)."""
    y = np.asarray(y, float)
    small = y < 0.05
    ys = np.where(small, y, 0.0)
    acc = np.zeros_like(ys)
    for k in range(14, 1, -1):  # Σ_{k≥2} (−1)^k y^k / k
        acc = acc * ys + (1.0 if k % 2 == 0 else -1.0) / k
    return np.where(small, acc * ys * ys, y - np.log1p(y))


def _known_precision(a, b):
    """(rows whose τ message is a known precision, a and b with those rows set to a benign 1, 1
    for the rule, which then ignores them)."""
    known = a > KNOWN_PRECISION_SHAPE
    return known, np.where(known, 1.0, a), np.where(known, 1.0, b)


def log_partition(incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
    """log ∫ N(x; m, 1/τ)^power N(m; m_m, v_m) Gamma(τ; a, b) N(x; m_x, v_x) dm dτ dx."""
    alpha, flat, shape, (mm, vm, a, b, mx, vx, S, D, ap) = _setup(incoming, power)
    if is_empty(shape):
        return np.zeros(shape)
    known, a_r, b_r = _known_precision(a, b)
    lz = _rule(a_r, 0.5 * (alpha - 1.0), b_r, S, D, alpha)[2] + gamma_normaliser(a_r)
    if known.any():  # L(τ₀) = N(m_x − m_m; 0, S + 1/(ατ₀)) with N^α's normaliser and τ₀^{(α−1)/2}, times
        # the rest of E[L(τ)] by :func:`_narrow_tau`
        s2 = S + b / (alpha * a)
        point = 0.5 * (alpha - 1.0) * np.log(a / b) - 0.5 * np.log(s2) - 0.5 * D / s2 + _narrow_tau(a, b, S, D, alpha)[2]
        lz = np.where(known, point, lz)
    lz = lz - 0.5 * np.log(2.0 * np.pi) + 0.5 * (1.0 - alpha) * np.log(2.0 * np.pi) - 0.5 * np.log(alpha)
    return lz.reshape(shape)


def sample(inputs: Mapping[str, np.ndarray], size: int, rng: np.random.Generator) -> np.ndarray:
    """x ~ N(m, 1/tau) for each of the ``size`` input pairs (tau > 0)."""
    ins, size = check_sample_inputs(NAME, INPUTS, inputs, size)
    tau = ins["tau"]
    if np.any(~(tau > 0)):
        raise ValueError(f"{NAME}: `inputs['tau']` must be > 0 (a precision)")
    return ins["m"] + rng.standard_normal(size) / np.sqrt(tau)
