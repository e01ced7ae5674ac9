"""Oracles: ground-truth EP messages for training pairs and for the just-in-time fallback.

Both oracles share the operator interface (batched: every message in ``incoming`` has the
same batch shape)::

    oracle.belief(incoming: dict[str, Family], to: str) -> Family   # q = proj[f · Π incoming]
    oracle.message(incoming, to) -> Family                          # q / incoming[to]

:class:`QuadratureOracle` — deterministic, for the built-in factors whose tilted distribution
is a 1-D integral (the "hand-crafted" operator).  The integrand exp(w(t)) is split at its
stationary and inflection points into pieces on which w is monotone; each piece is cut again
where w crosses fixed levels below its maximum (w_max − 0.1, 0.5, …, 50), so every panel spans a
bounded change of the integrand whatever its scale; each panel gets a Gauss–Legendre rule.
All of it is vectorised over the batch.  Probit-with-label-noise is a two-piece truncated
Gaussian and is done in closed form.

:class:`ImportanceSamplingOracle` — for any sampleable factor (SPEC §3, paper eq. 4): draw
x_in ~ proposal, x_out ~ f(· | x_in); weights w = Π_W m_{W→f}(x_W) / proposal(x_in),
self-normalised.  Because every message is an exponential family, log w for a whole batch is
one matrix product of natural parameters with sufficient statistics.  The effective sample
size of each message is kept in ``last_ess_``; a message whose ESS is below ``min_ess`` is an
oracle failure (:class:`LowESSError`), never a silent bad answer.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from scipy import special

from .factors import CompoundGamma, Factor, Logistic, ProbitNoise
from .families import Bernoulli, Beta, Family, Gamma, Gaussian

__all__ = [
    "logistic_tilted_rule",
    "two_piece_moments",
    "LOG_SQRT_2PI",
    "Oracle",
    "QuadratureOracle",
    "ImportanceSamplingOracle",
    "LowESSError",
    "OracleError",
]


class OracleError(RuntimeError):
    """An oracle could not produce a trustworthy message.  ``rows``: the failing positions of
    the batch when known (the EP engine then skips exactly those and asks again for the rest)."""

    def __init__(self, message: str = "", rows=None):
        super().__init__(message)
        if rows is not None:
            self.rows = np.asarray(rows, dtype=int).ravel()


def _gaussian_or_error(mean, var, what: str) -> Gaussian:
    """``Gaussian(mean, var)``, or an OracleError naming the rows whose moments are not a
    distribution (underflowed variance, overflowed mean) instead of a bare ValueError for the batch."""
    bad = ~(np.isfinite(mean) & np.isfinite(var) & (var > 0))
    if np.any(bad):
        rows = np.flatnonzero(bad)
        raise OracleError(
            f"{what}: the tilted moments of rows {rows[:10].tolist()}{'…' if rows.size > 10 else ''} are not a "
            "distribution in double precision (variance underflowed to 0 or a moment overflowed)", rows=rows)
    return Gaussian(mean, var)


class LowESSError(OracleError):
    """Importance sampling produced too small an effective sample size for some rows."""

    def __init__(self, rows, ess, min_ess):
        self.rows = np.asarray(rows)
        self.ess = np.asarray(ess)
        self.min_ess = min_ess
        super().__init__(
            f"importance sampling failed for {self.rows.size} message(s): effective sample size "
            f"{float(np.min(self.ess)):.3g} < min_ess={min_ess} (rows {self.rows[:10].tolist()}"
            f"{'…' if self.rows.size > 10 else ''}); use a better proposal or more samples"
        )


class Oracle:
    """Common interface: subclasses implement ``_belief_stats`` (expected suff. stats)."""

    factor: Factor

    def _prepare(self, incoming, to):
        inc, shape = self.factor.check_incoming(incoming, to)
        flat = {v: m.ravel() for v, m in inc.items()}
        return flat, shape

    def belief(self, incoming: Mapping[str, Family], to: str) -> Family:
        flat, shape = self._prepare(incoming, to)
        return self._belief_flat(flat, to).reshape(shape)

    def message(self, incoming: Mapping[str, Family], to: str) -> Family:
        flat, shape = self._prepare(incoming, to)
        q = self._belief_flat(flat, to)
        return (q / flat[to]).reshape(shape)

    def _belief_flat(self, flat, to) -> Family:
        raise NotImplementedError


# ====================================================================== 1-D quadrature
_LEVELS = np.array([0.1, 0.5, 1.5, 3.0, 6.0, 10.0, 15.0, 21.0, 28.0, 36.0, 50.0])
_CUTOFF = 55.0  # below w_max − _CUTOFF the integrand is < 1.3e-24 of its peak: ignored
_GL_N = 12
_BISECT_LEVEL = 24  # level crossings to 2^-24 of their segment: panel ends need not be exact
_GL_X, _GL_W = np.polynomial.legendre.leggauss(_GL_N)


def _bisect(g, lo, hi, n_iter):
    """Vectorised bisection for a sign change of g on [lo, hi] (g(lo) and g(hi) of opposite sign)."""
    glo = g(lo)
    for _ in range(n_iter):
        mid = 0.5 * (lo + hi)
        gm = g(mid)
        same = np.sign(gm) == np.sign(glo)
        lo = np.where(same, mid, lo)
        glo = np.where(same, gm, glo)
        hi = np.where(same, hi, mid)
    return 0.5 * (lo + hi)


def _panel_rule(logf, breaks, step):
    """Nodes and normalised log-weights of the level-panel rule for exp(logf).

    logf(t, rows=None): vectorised log integrand; with ``rows`` None, ``t`` has shape (B, ...)
    and logf broadcasts its per-message parameters as (B, 1, ...); otherwise ``t`` is 1-D and
    ``rows`` gives the message of each entry.  ``breaks`` (B, K): points that include every
    stationary point of logf, so logf is monotone between consecutive sorted breaks and on
    the two outer half-lines.  ``step`` (B,): a length scale for the outward search.

    Returns ``(t, logw, log_z)``: nodes (B, N), log weights normalised to sum to one, and the
    log integral.
    """
    breaks = np.sort(breaks, axis=1)
    B, K = breaks.shape
    fb = logf(breaks)
    wmax = np.max(fb, axis=1)
    # outer ends: walk outward (doubling) until logf < wmax − cutoff; logf is monotone there
    ends = []
    for side, edge in ((-1.0, breaks[:, 0]), (1.0, breaks[:, -1])):
        d = np.maximum(step, 1e-300)
        for _ in range(200):
            val = logf((edge + side * d)[:, None])[:, 0]
            more = val > wmax - _CUTOFF
            if not more.any():
                break
            d = np.where(more, 2.0 * d, d)
        ends.append(edge + side * d)
    pts = np.concatenate([ends[0][:, None], breaks, ends[1][:, None]], axis=1)  # (B, K+2)
    a, b = pts[:, :-1], pts[:, 1:]  # segments (B, S)
    fa, fb_ = logf(a), logf(b)
    target = wmax[:, None, None] - _LEVELS[None, None, :]  # (B, 1, L)
    FA, FB = fa[..., None], fb_[..., None]
    inside = (target - FA) * (target - FB) < 0  # level crossed strictly inside the segment
    # bisection for logf(t) = target, only on the (row, segment, level) entries crossed
    ib, is_, il = np.nonzero(inside)
    lo, hi = a[ib, is_], b[ib, is_]
    tgt = wmax[ib] - _LEVELS[il]
    sign_lo = np.sign(fa[ib, is_] - tgt)
    for _ in range(_BISECT_LEVEL):
        mid = 0.5 * (lo + hi)
        same = np.sign(logf(mid, ib) - tgt) == sign_lo
        lo = np.where(same, mid, lo)
        hi = np.where(same, hi, mid)
    # panel end points: segment ends and crossings; rows padded with copies of their last point
    count = np.bincount(ib, minlength=B)
    width = K + 2 + int(count.max(initial=0))
    allpts = np.repeat(pts[:, -1:], width, axis=1)
    allpts[:, : K + 2] = pts
    order = np.argsort(ib, kind="stable")
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    slot = np.arange(ib.size) - start[ib[order]]
    allpts[ib[order], K + 2 + slot] = (0.5 * (lo + hi))[order]
    allpts.sort(axis=1)
    left, right = allpts[:, :-1], allpts[:, 1:]
    half = 0.5 * (right - left)
    centre = 0.5 * (right + left)
    t = (centre[..., None] + half[..., None] * _GL_X).reshape(B, -1)
    with np.errstate(divide="ignore"):
        lw_rule = np.log(np.maximum(half, 0.0)[..., None] * _GL_W).reshape(B, -1)
    with np.errstate(divide="ignore"):
        lw = logf(t) + lw_rule
    lw = np.where(np.isfinite(lw), lw, -np.inf)
    m = np.max(lw, axis=1, keepdims=True)
    s = np.sum(np.exp(lw - m), axis=1, keepdims=True)
    log_z = (m + np.log(s))[:, 0]
    return t, lw - log_z[:, None], log_z


# the logistic's bends: fixed split points so no panel straddles the transition of σ
_LOGISTIC_BENDS = np.array([-6.0, -3.0, -1.5, 0.0, 1.5, 3.0, 6.0])


def logistic_tilted_rule(mu, v, alpha, beta, weight: int = 0):
    """Panel rule for r(x) ∝ N(x; mu, v) · σ(x)^(α−1) σ(−x)^(β−1) (log normaliser included).

    ``weight`` = +1 / −1 multiplies the integrand by softplus(−x) = −log σ(x) /
    softplus(x) = −log σ(−x), so that E[log σ(±x)] is integrated with panels placed for its
    own integrand: relative accuracy even when the statistic lives in the far tail.
    """
    mu, v, alpha, beta = (np.asarray(p, float) for p in (mu, v, alpha, beta))
    am1, bm1 = alpha - 1.0, beta - 1.0

    ab = am1 + bm1

    def col(p, t, rows):
        return p[rows] if rows is not None else p.reshape(p.shape + (1,) * (t.ndim - 1))

    def logf0(t, rows=None):
        m, vv, c, b1 = (col(p, t, rows) for p in (mu, v, ab, bm1))
        # (α−1) log σ(t) + (β−1) log σ(−t) = −(α+β−2) softplus(−t) − (β−1) t
        return -0.5 * (t - m) ** 2 / vv - c * np.logaddexp(0.0, -t) - b1 * t

    def dlogf0(t):
        return -(t - mu) / v + am1 * special.expit(-t) - bm1 * special.expit(t)

    def log_softplus(t):  # log log(1 + e^t), stable in both tails
        with np.errstate(divide="ignore"):  # the unused branch underflows for t ≪ 0
            return np.where(t < -30.0, t, np.log(np.logaddexp(0.0, np.minimum(t, 700.0)) + (t > 700.0) * (t - 700.0)))

    def dlog_softplus(t):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(t < -30.0, 1.0, special.expit(t) / np.logaddexp(0.0, t))

    if weight:
        def logf(t, rows=None):
            return logf0(t, rows) + log_softplus(-weight * t)

        def dlogf(t):
            return dlogf0(t) - weight * dlog_softplus(-weight * t)
    else:
        logf, dlogf = logf0, dlogf0

    # w'' = −1/v − (α+β−2) σ(t)σ(−t): concave unless α+β < 2 and v large; then w' has the
    # inflection points ±t0 with σσ(−t0) = 1/(v (2−α−β)) and w at most three stationary points.
    c = 2.0 - alpha - beta
    with np.errstate(divide="ignore", invalid="ignore"):
        k = 1.0 / (v * c)
        nonconcave = (c > 0) & (k < 0.25)
        root = np.sqrt(np.clip(1.0 - 4.0 * np.where(nonconcave, k, 0.0), 0.0, 1.0))
        t0 = np.where(nonconcave, special.logit(0.5 * (1.0 + root)), 0.0)
    M = np.abs(am1) + np.abs(bm1)
    far_lo = mu - v * M - 1.0
    far_hi = mu + v * M + 1.0
    # stationary points: in (−∞, −t0], [−t0, t0], [t0, ∞) (one interval when concave)
    g_m, g_p = dlogf(-t0), dlogf(t0)
    r1 = _bisect(dlogf, far_lo, np.where(nonconcave, -t0, far_hi), 100)
    r3 = _bisect(dlogf, np.where(nonconcave, t0, far_lo), far_hi, 100)
    r2 = _bisect(dlogf, -t0, t0, 100)
    has1 = ~nonconcave | (g_m < 0)
    has3 = nonconcave & (g_p > 0)
    has2 = nonconcave & (g_m < 0) & (g_p > 0)
    anchor = np.where(has1, r1, np.where(has3, r3, r2))
    r1 = np.where(has1, r1, anchor)
    r2 = np.where(has2, r2, anchor)
    r3 = np.where(has3, r3, anchor)
    bends = np.broadcast_to(_LOGISTIC_BENDS, (anchor.size, _LOGISTIC_BENDS.size))
    breaks = np.concatenate(
        [np.stack([r1, r2, r3, np.where(nonconcave, -t0, anchor), np.where(nonconcave, t0, anchor)], axis=1), bends],
        axis=1,
    )
    if weight:
        # the weighted integrand's stationary points: a root of its derivative in each gap
        # between the unweighted integrand's break points (the weight is log-concave and
        # monotone, so this adds at most a few points)
        pts = np.sort(np.concatenate([far_lo[:, None], breaks, far_hi[:, None]], axis=1), axis=1)
        lo_, hi_ = pts[:, :-1], pts[:, 1:]
        flat_lo, flat_hi = lo_.ravel(), hi_.ravel()
        rep = lambda p: np.repeat(p, lo_.shape[1])  # noqa: E731
        mu_r, v_r, am1_r, bm1_r = rep(mu), rep(v), rep(am1), rep(bm1)

        def dg(t):
            d0 = -(t - mu_r) / v_r + am1_r * special.expit(-t) - bm1_r * special.expit(t)
            return d0 - weight * dlog_softplus(-weight * t)

        has = (np.sign(dg(flat_lo)) != np.sign(dg(flat_hi))).reshape(lo_.shape)
        roots = _bisect(dg, flat_lo, flat_hi, 200).reshape(lo_.shape)
        breaks = np.concatenate([breaks, np.where(has, roots, anchor[:, None])], axis=1)
    # curvature scale at the main mode for the outward search
    curv = 1.0 / v + np.maximum(alpha + beta - 2.0, 0.0) * special.expit(anchor) * special.expit(-anchor)
    step = np.minimum(1.0 / np.sqrt(curv), np.sqrt(v))
    t, lw, log_z = _panel_rule(logf, breaks, step)
    # normaliser of N(x; mu, v) Beta(σ(x); α, β)
    log_z = log_z - 0.5 * np.log(2 * np.pi * v) - special.betaln(alpha, beta)
    return t, lw, log_z


def _compound_gamma_rule(factor: CompoundGamma, a, b):
    """Panel rule in u = log τ for r(τ) ∝ p_cg(τ) · Gamma(τ; a, b) (Jacobian e^u included)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    s1, r1, s2 = factor.s1, factor.r1, factor.s2
    c1 = s2 + a - 1.0  # coefficient of u: τ^(s2−1) τ^(a−1) and the Jacobian dτ = τ du
    if np.any(~(c1 > 0)):
        raise OracleError(
            "compound-gamma tilted distribution is improper: need s2 + shape - 1 > 0 "
            "(τ^(s2+a-2) is not integrable at 0)"
        )

    def col(p, t, rows):
        return p[rows] if rows is not None else p.reshape(p.shape + (1,) * (t.ndim - 1))

    def logf(u, rows=None):
        cc, bb = col(c1, u, rows), col(b, u, rows)
        return cc * u - (s1 + s2) * np.logaddexp(np.log(r1), u) - bb * np.exp(u)

    def dlogf(u):
        return c1 - (s1 + s2) * special.expit(u - np.log(r1)) - b * np.exp(u)

    u_hi = np.log(c1 / b) + 1.0
    u_lo = np.log(c1 / ((s1 + s2) / r1 + b)) - 1.0
    mode = _bisect(dlogf, u_lo, u_hi, 200)
    curv = (s1 + s2) * special.expit(mode - np.log(r1)) * special.expit(np.log(r1) - mode) + b * np.exp(mode)
    step = 1.0 / np.sqrt(curv)
    t, lw, log_z = _panel_rule(logf, mode[:, None], step)
    log_z = (
        log_z
        + special.gammaln(s1 + s2) - special.gammaln(s1) - special.gammaln(s2) + s1 * np.log(r1)
        + a * np.log(b) - special.gammaln(a)
    )
    return t, lw, log_z


# below this v·(α + β + 1) the logistic belief on x is its second-order (Laplace) limit
_POINT_MASS = 1e-10


def _logistic_point_mass_limit(mu, v, alpha, beta, mean, var):
    """Where the cavity N(mu, v) is nearly a point mass on the scale of the factor
    l(x) = (α−1) log σ(x) + (β−1) log σ(−x) (v·(α+β+1) < 1e-10), the tilted distribution is
    N(mu + v_q l'(mu), v_q), 1/v_q = 1/v − l''(mu), up to a relative O(v) in the variance (the
    next terms carry the third derivative of l); the panel rule there can underflow the variance
    to 0 (v ~ 1e-23) and loses the message precision 1/v_q − 1/v to round-off long before."""
    mu, v = np.asarray(mu, float), np.asarray(v, float)
    a, b = np.asarray(alpha, float), np.asarray(beta, float)
    pm = v * (a + b + 1.0) < _POINT_MASS
    if not np.any(pm):
        return mean, var
    mean, var = np.array(mean, dtype=float), np.array(var, dtype=float)
    mean[pm], var[pm] = logistic_laplace_limit(mu[pm], v[pm], a[pm], b[pm])
    return mean, var


def logistic_laplace_limit(mu, v, alpha, beta):
    """Mean and variance of N(x; mu, v)·σ(x)^(α−1)σ(−x)^(β−1) to second order in the cavity
    (exact as v → 0): precision 1/v − l''(mu), mean mu + v_q l'(mu)."""
    s_pos, s_neg = special.expit(mu), special.expit(-mu)
    d1 = (alpha - 1.0) * s_neg - (beta - 1.0) * s_pos          # l'(mu)
    d2 = -(alpha + beta - 2.0) * s_pos * s_neg                 # l''(mu)
    vq = v / (1.0 - v * d2)                                    # 1 / (1/v − l'')
    return mu + vq * d1, vq


def _weighted_mean_var(t, lw):
    w = np.exp(lw)
    mean = np.sum(w * t, axis=1)
    var = np.sum(w * (t - mean[:, None]) ** 2, axis=1)
    return mean, var


LOG_SQRT_2PI = 0.5 * np.log(2 * np.pi)


def _lower_truncated_std(alpha, n_terms: int = 80):
    """Mean λ and variance of N(0, 1) truncated to [α, ∞), accurate in the far tail.

    For α < 5: λ = φ(α)/Φ(−α) and var = 1 − λ(λ − α) (mild cancellation).  For α ≥ 5 the
    Mills-ratio continued fraction R = 1/(α + c), c = 1/(α + d), d = 2/(α + 3/(α + …)) gives
    λ = α + c and var = c² (α d + d² − 1) with no cancellation (var ≈ 1/α² for large α); the
    continued fraction is evaluated only on the tail entries.
    """
    alpha = np.asarray(alpha, float)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        lam = np.exp(-0.5 * alpha * alpha - LOG_SQRT_2PI - special.log_ndtr(-alpha))
        var = 1.0 - lam * (lam - alpha)
    tail = alpha >= 5.0
    if np.any(tail):
        a = alpha[tail]
        t = np.zeros_like(a)
        for k in range(n_terms, 1, -1):
            t = k / (a + t)
        c = 1.0 / (a + t)
        lam = np.array(lam, dtype=float, copy=True)
        var = np.array(var, dtype=float, copy=True)
        lam[tail] = a + c
        var[tail] = c * c * (a * t + t * t - 1.0)
    return lam, np.maximum(var, 0.0)


def two_piece_moments(mu, v, log_c_pos, log_c_neg):
    """Tilted moments of ``N(f; mu, v) · [c₊ Θ(f) + c₋ Θ(−f)]`` (log weights; −inf allowed).

    Returns ``(log Z, mean, var, π₊)`` with π₊ the tilted mass of ``f > 0``.  Each piece is a
    truncated Gaussian; its moments come from :func:`_lower_truncated_std` (accurate in the far
    tail).  Used by the probit oracle (weights ε + (1−2ε)p, ε + (1−2ε)(1−p)) and by power EP
    (the weights to the power u).
    """
    mu, v, lcp, lcn = np.broadcast_arrays(*(np.asarray(a, dtype=float) for a in (mu, v, log_c_pos, log_c_neg)))
    s = np.sqrt(v)
    z = mu / s
    with np.errstate(divide="ignore", invalid="ignore"):
        lp = lcp + special.log_ndtr(z)
        ln = lcn + special.log_ndtr(-z)
        log_z = np.logaddexp(lp, ln)
        pi_pos = np.exp(lp - log_z)
        pi_neg = np.exp(ln - log_z)
    lam_p, tv_p = _lower_truncated_std(-z)
    lam_n, tv_n = _lower_truncated_std(z)
    m_pos = mu + s * lam_p
    m_neg = mu - s * lam_n
    with np.errstate(invalid="ignore"):
        mean = np.where(pi_neg == 0, m_pos, np.where(pi_pos == 0, m_neg, pi_pos * m_pos + pi_neg * m_neg))
        d_pos = np.where(pi_pos > 0, v * tv_p + (m_pos - mean) ** 2, 0.0)
        d_neg = np.where(pi_neg > 0, v * tv_n + (m_neg - mean) ** 2, 0.0)
        var = pi_pos * d_pos + pi_neg * d_neg
    return log_z, mean, var, pi_pos


def _probit_moments(mu, v, p, eps):
    """Closed-form tilted moments for N(f; mu, v) · [ε + (1−2ε)(p Θ(f) + (1−p) Θ(−f))].

    Returns (log Z, mean, var, P(y=+1 | tilted)).  The tilted distribution is a mixture of
    the two truncations of the Gaussian at 0, weighted c₊Φ(z) and c₋Φ(−z).
    """
    c_pos = eps + (1 - 2 * eps) * p
    c_neg = eps + (1 - 2 * eps) * (1 - p)
    with np.errstate(divide="ignore"):
        log_z, mean, var, _ = two_piece_moments(mu, v, np.log(c_pos), np.log(c_neg))
    z = mu / np.sqrt(v)
    # posterior on y: P(y=+1) ∝ p · (ε + (1−2ε)Φ(z)), in logs: a label certain a priori (p = 0
    # or 1) against a Φ that underflows is not 0/0
    with np.errstate(divide="ignore", invalid="ignore"):
        log_eps, log_1m2eps = np.log(eps), np.log1p(-2 * eps)
        lp = np.log(p) + np.logaddexp(log_eps, log_1m2eps + special.log_ndtr(z))
        ln = np.log1p(-p) + np.logaddexp(log_eps, log_1m2eps + special.log_ndtr(-z))
        py = special.expit(lp - ln)
    return log_z, mean, var, py


class QuadratureOracle(Oracle):
    """Deterministic oracle for the built-in factors (the hand-crafted baseline operator).

    Relative error ≤ 1e-8 on the moments over means in ±50, variances 1e-4..1e4,
    Beta α, β in 0.5..1000 and Gamma shape 1e-2..1e4 (tested against brute-force grids).
    ``log_partition(incoming)`` gives log ∫ f Π m (messages normalised) for EP's evidence.
    """

    def __init__(self, factor: Factor):
        if not isinstance(factor, (Logistic, CompoundGamma, ProbitNoise)):
            raise ValueError(
                f"QuadratureOracle has no rule for factor {getattr(factor, 'name', factor)!r}; "
                "use ImportanceSamplingOracle for user factors"
            )
        self.factor = factor

    def __repr__(self):
        return f"QuadratureOracle({self.factor!r})"

    def _tilted(self, flat, to):
        f = self.factor
        if isinstance(f, Logistic):
            x, z = flat["x"], flat["z"]
            t, lw, log_z = logistic_tilted_rule(x.mean(), x.var(), z.alpha, z.beta)
            if to == "x":
                mean, var = _weighted_mean_var(t, lw)
                mean, var = _logistic_point_mass_limit(x.mean(), x.var(), z.alpha, z.beta, mean, var)
                return _gaussian_or_error(mean, var, "logistic belief on x"), log_z
            if to == "z":
                # E[log σ(x)] = −∫ r softplus(−x) / Z, each integral with its own panels
                args = (x.mean(), x.var(), z.alpha, z.beta)
                lz_neg = logistic_tilted_rule(*args, weight=+1)[2]
                lz_pos = logistic_tilted_rule(*args, weight=-1)[2]
                ess = np.stack([-np.exp(lz_neg - log_z), -np.exp(lz_pos - log_z)], axis=-1)
                if np.any(~(ess < 0)):
                    bad = np.flatnonzero(~np.all(ess < 0, axis=1))
                    raise OracleError(
                        f"belief on z is numerically degenerate for rows {bad[:10].tolist()}: the tilted "
                        "distribution sits within exp(-745) of z = 0 or 1, beyond double precision"
                    )
                try:
                    return Beta.project(ess), log_z
                except ValueError as exc:
                    raise OracleError(f"belief on z cannot be represented: {exc}") from None
            return None, log_z
        if isinstance(f, CompoundGamma):
            tau = flat["tau"]
            u, lw, log_z = _compound_gamma_rule(f, tau.shape_param, tau.rate)
            if to is None:
                return None, log_z
            w = np.exp(lw)
            mx = np.max(u, axis=1, keepdims=True)
            # E[τ] = Σ w e^u, computed with a shift for range safety
            e_tau = np.exp(mx[:, 0]) * np.sum(w * np.exp(u - mx), axis=1)
            e_log = np.sum(w * u, axis=1)
            return Gamma.project(np.stack([e_tau, e_log], axis=-1)), log_z
        # ProbitNoise
        fm, y = flat["f"], flat["y"]
        log_z, mean, var, py = _probit_moments(fm.mean(), fm.var(), y.p, f.eps)
        if to == "f":
            return _gaussian_or_error(mean, var, "probit belief on f (cavity far in the tail)"), log_z
        if to == "y":
            return Bernoulli(py), log_z
        return None, log_z

    def _belief_flat(self, flat, to):
        return self._tilted(flat, to)[0]

    def message(self, incoming: Mapping[str, Family], to: str) -> Family:
        flat, shape = self._prepare(incoming, to)
        if isinstance(self.factor, ProbitNoise) and to == "y":
            # the message to the label is the likelihood itself; computing it as q / m_y
            # would give inf − inf for an observed label (p = 0 or 1)
            fm, eps = flat["f"], self.factor.eps
            z = fm.mean() / np.sqrt(fm.var())
            like_pos = eps + (1 - 2 * eps) * special.ndtr(z)
            like_neg = eps + (1 - 2 * eps) * special.ndtr(-z)
            return Bernoulli(like_pos / (like_pos + like_neg)).reshape(shape)
        return (self._belief_flat(flat, to) / flat[to]).reshape(shape)

    def log_partition(self, incoming: Mapping[str, Family]) -> np.ndarray:
        """log ∫ f(x) Π_W m_{W→f}(x_W) dx for normalised incoming messages."""
        flat, shape = self._prepare(incoming, None)
        return self._tilted(flat, None)[1].reshape(shape)


# ====================================================================== importance sampling
_DEFAULT_PROPOSALS = {
    Gaussian: lambda: Gaussian(0.0, 200.0),  # the KJIT paper's proposal on the logistic input
    Beta: lambda: Beta(1.0, 1.0),
    Gamma: lambda: Gamma(1.0, 0.1),
    Bernoulli: lambda: Bernoulli(0.5),
}


_LOG_W_FLOOR = -350.0


class ImportanceSamplingOracle(Oracle):
    """Self-normalised importance sampling for any sampleable factor (SPEC §3).

    Parameters
    ----------
    factor : Factor
    n_samples : particles per call (the paper uses 5×10^5); all messages of a batch share
        the particles, so a message's answer does not depend on the batch it came in.
    proposal : dict variable → scalar Family message for each input variable (default
        N(0, 200) for Gaussian inputs, as in the paper; Beta(1,1); Gamma(1, 0.1)).
    min_ess : messages whose effective sample size is below this raise :class:`LowESSError`.
    random_state : seed, SeedSequence or Generator; each particle draw advances it.
    chunk : messages per vectorised block (memory ≈ chunk × n_samples × 8 bytes).
    reuse : calls served by one particle draw (default 1: fresh particles for every call).
        Drawing 5×10^5 particles and their statistics is a fixed cost per call (~40–120 ms
        here, against ~7 ms per message); a caller that asks for a few messages at a time —
        a just-in-time operator consulting on its uncertain rows — pays mostly that.  With
        ``reuse`` = r, r consecutive calls share one draw: each answer is the same
        self-normalised estimate with the same variance, but the errors of answers within those
        r calls are correlated (as those of one batch always are).
    """

    def __init__(self, factor: Factor, n_samples: int = 500_000, proposal=None, min_ess: float = 50.0,
                 random_state=None, chunk: int = 16, reuse: int = 1):
        if int(n_samples) < 2:
            raise ValueError("`n_samples` must be >= 2")
        if not min_ess >= 1:
            raise ValueError("`min_ess` must be >= 1")
        if int(reuse) < 1:
            raise ValueError("`reuse` must be >= 1")
        self.reuse = int(reuse)
        self._pool = None          # (stats, log_r, U) of the current draw
        self._pool_calls = 0       # calls it has served
        self._pool_rng_state = None  # generator state just before it was drawn
        self.factor = factor
        self.n_samples = int(n_samples)
        self.min_ess = float(min_ess)
        self.random_state = random_state
        self.chunk = int(chunk)
        proposal = dict(proposal or {})
        for v in factor.inputs:
            if v not in proposal:
                proposal[v] = _DEFAULT_PROPOSALS[factor.families[v]]()
            if not isinstance(proposal[v], factor.families[v]) or proposal[v].shape != ():
                raise ValueError(f"`proposal[{v!r}]` must be a scalar {factor.families[v].__name__} message")
        unknown = set(proposal) - set(factor.inputs)
        if unknown:
            raise ValueError(f"`proposal` names non-input variable(s) {sorted(unknown)}")
        self.proposal = proposal
        self._rng = np.random.default_rng(random_state)
        self.last_ess_ = None

    def __repr__(self):
        return f"ImportanceSamplingOracle({self.factor!r}, n_samples={self.n_samples})"

    def get_params(self):
        return dict(factor=self.factor, n_samples=self.n_samples, proposal=self.proposal,
                    min_ess=self.min_ess, random_state=self.random_state, chunk=self.chunk, reuse=self.reuse)

    def with_random_state(self, random_state):
        return type(self)(**{**self.get_params(), "random_state": random_state})

    def _draw(self):
        f, n, rng = self.factor, self.n_samples, self._rng
        draws = {v: self.proposal[v].sample(n, rng) for v in f.inputs}
        draws[f.output] = f.sample(draws, n, rng)
        log_r = np.zeros(n)
        for v in f.inputs:
            log_r += self.proposal[v].log_pdf(draws[v])
        stats = {v: f.suff_stats(v, draws) for v in f.variables}
        # particles whose statistics are not finite (an output rounded onto the boundary of
        # its support, e.g. a Beta variable at exactly 0 or 1) are a floating-point artefact
        # of probability zero: drop them
        if np.isfinite(log_r).all() and all(np.isfinite(u).all() for u in stats.values()):
            return stats, log_r  # the usual case, checked with whole-array reductions
        keep = np.isfinite(log_r)
        for u in stats.values():
            keep &= np.isfinite(u).all(axis=1)
        if not keep.all():
            stats = {v: u[keep] for v, u in stats.items()}
            log_r = log_r[keep]
        return stats, log_r

    def _particles(self):
        """``(stats, log_r, U)`` for this call: a fresh draw every ``reuse`` calls.  ``U`` stacks
        the particles' statistics of every variable and −log r (see :meth:`_estimate_flat`)."""
        if self._pool is None or self._pool_calls >= self.reuse:
            rng_state = self._rng.bit_generator.state
            stats, log_r = self._draw()
            f = self.factor
            U = np.empty((sum(s.shape[1] for s in stats.values()) + 1, len(log_r)))
            col = 0
            for v in f.variables:
                k = stats[v].shape[1]
                U[col: col + k] = stats[v].T
                col += k
            np.negative(log_r, out=U[col])
            self._pool, self._pool_calls, self._pool_rng_state = (stats, log_r, U), 0, rng_state
        self._pool_calls += 1
        pool = self._pool
        if self.reuse == 1:
            self._pool = None  # nothing to keep: free the memory
        return pool

    def pool_state(self) -> dict:
        """Where the particle reuse stands (for saving): the generator state before the current
        draw and the calls it has served; :meth:`set_pool_state` redraws the same particles."""
        return {"calls": self._pool_calls if self._pool is not None else 0,
                "rng_state": self._pool_rng_state if self._pool is not None else None}

    def set_pool_state(self, state: Mapping) -> None:
        calls = int(state.get("calls", 0))
        if calls and state.get("rng_state") is not None:
            after = self._rng.bit_generator.state
            self._rng.bit_generator.state = state["rng_state"]
            self._pool = None
            self._particles()
            self._pool_calls = calls
            if self._rng.bit_generator.state != after:
                raise ValueError("the saved particle draw does not lead to the saved generator state")

    def estimate(self, incoming: Mapping[str, Family], to: str):
        """Tilted expectations of the sufficient statistics of ``to``, and the ESS.

        Returns ``(stats (n, k), ess (n,))`` for the flattened batch and never raises on a low
        ESS, so callers (e.g. training-set generation) can drop failed rows.  For a Gaussian
        recipient the second column is the (centred) variance, not E[x²].
        """
        flat, _ = self._prepare(incoming, to)
        return self._estimate_flat(flat, to)

    def _estimate_flat(self, flat, to):
        f = self.factor
        stats, log_r, U = self._particles()
        B = next(iter(flat.values())).size
        u_to = stats[to]  # (N, k)
        N = len(log_r)
        centred = f.families[to] is Gaussian
        # log w = Σ_W η_W · u_W(x_W) − log r(x_in) (message normalisers cancel) is one matrix
        # product of the batch's natural parameters H (B, K+1) with the particles' statistics
        # U (K+1, N) = [u_W ..., −log r]; the weighted sums Σ w u_to are a second one (for a
        # Gaussian recipient u = (x, x²), and the variance is E x² − (E x)², recomputed centred
        # where that could lose digits), so a chunk of rows costs ~6 passes over its (rows, N)
        # weight matrix instead of the ~15 of elementwise temporaries.
        etas = [flat[v].natural().reshape(B, -1) for v in f.variables]
        H = np.concatenate(etas + [np.ones((B, 1))], axis=1)
        # rows with an infinite natural parameter (e.g. an observed Bernoulli label) take the
        # generic path, where 0 · ±inf counts as 0
        generic = ~np.all(np.isfinite(H), axis=1)
        out = np.empty((B, u_to.shape[1]))
        ess = np.empty(B)
        for s in range(0, B, self.chunk):
            sl = slice(s, min(B, s + self.chunk))
            if generic[sl].any():
                lw = -log_r[None, :]
                for v in f.variables:
                    lw = lw + flat[v][sl].log_kernel(stats[v])
            else:
                lw = H[sl] @ U
            lw -= np.max(lw, axis=1, keepdims=True)
            # floor the relative log weights at −350: the particles below carry < e^-350 of the
            # largest weight each (< 1e-146 of the total together), and exp / products of values
            # that underflow towards subnormals are many times slower on x86
            np.maximum(lw, _LOG_W_FLOOR, out=lw)
            np.exp(lw, out=lw)
            s0 = np.sum(lw, axis=1)
            ess[sl] = s0 * s0 / np.einsum("ij,ij->i", lw, lw)
            mom = (lw @ u_to) / s0[:, None]  # Gaussian: u = (x, x²), so (E x, E x²)
            if centred:
                mean = mom[:, 0]
                var = mom[:, 1] - mean * mean
                # E[x²] − E[x]² loses ~ log10(mean²/var) digits: recompute the rows where that
                # could show against double precision the centred way (rare: |mean| > 1e3 sd)
                bad = ~(var > 1e-6 * mean * mean)
                if bad.any():
                    x = u_to[:, 0]
                    for i in np.flatnonzero(bad):
                        var[i] = np.dot(lw[i], (x - mean[i]) ** 2) / s0[i]
                out[sl, 0] = mean
                out[sl, 1] = var
            else:
                out[sl] = mom
        self.last_ess_ = ess
        return out, ess

    def _belief_flat(self, flat, to):
        ess_stats, ess = self._estimate_flat(flat, to)
        low = np.flatnonzero(~(ess >= self.min_ess))
        if low.size:
            raise LowESSError(low, ess[low], self.min_ess)
        fam = self.factor.families[to]
        if fam is Gaussian:
            if np.any(~(ess_stats[:, 1] > 0)):
                raise OracleError("importance-sampling variance estimate is not positive")
            return Gaussian(ess_stats[:, 0], ess_stats[:, 1])
        return fam.project(ess_stats)
