"""Numerical building blocks of the exact (quadrature / closed-form) rules of the factors.

Nothing here knows a factor: the factor modules (:mod:`kjit.factors`) build their rules from

* :func:`panel_rule` — the level-panel Gauss–Legendre rule for a 1-D integrand exp(w(t)): split
  at the integrand's stationary and inflection points into pieces on which w is monotone, each
  cut again where w crosses fixed levels below its maximum (w_max − 0.1, 0.5, …, 50), so every
  panel spans a bounded change of the integrand whatever its scale; vectorised over the batch;
* :func:`bisect` — vectorised bisection;
* :func:`weighted_mean_var` — moments from a normalised rule;
* :func:`two_piece_moments` — tilted moments of a Gaussian times a two-piece step (truncated
  Gaussians accurate in the far tail).
"""

from __future__ import annotations

import numpy as np
from scipy import special

__all__ = ["panel_rule", "bisect", "weighted_mean_var", "two_piece_moments", "lower_truncated_excess",
           "LOG_SQRT_2PI", "gaussian_kl"]

_LEVELS = np.array([0.1, 0.5, 1.5, 3.0, 6.0, 10.0, 15.0, 21.0, 28.0, 36.0, 50.0])
_CUTOFF = 55.0  # below w_max − _CUTOFF the integrand is < 1.3e-24 of its peak: ignored
_GL_N = 12
_BISECT_LEVEL = 24  # level crossings to 2^-24 of their segment: panel ends need not be exact
_BISECT_SCALE = 12  # ... and to 2^-12 of the row's length scale (``step``), where that is finer
_GL_X, _GL_W = np.polynomial.legendre.leggauss(_GL_N)


#: bisection's cap: ~1100 halvings take any finite bracket to the spacing of doubles
BISECT_MAX_ITER = 1100


def bisect(g, lo, hi, n_iter):
    """Vectorised bisection for a sign change of g on [lo, hi] (g(lo) and g(hi) of opposite sign):
    ``n_iter`` halvings, then more (up to :data:`BISECT_MAX_ITER` in all) while some bracket is
    still wider than 1e-12 of its midpoint's size (at least 1) — a bracket as wide as 1e100 (the
    logistic factor's for a Beta(1, 1e100) message) needs ~400, and 100 left the root at ~1e69
    (found in review: the exact belief was answered as N(−3.9e69, 5e138)).  A bracket already that
    narrow does not move under more halvings, so answers that converged in ``n_iter`` are unchanged."""
    glo = g(lo)
    done, todo = 0, n_iter
    while True:
        for _ in range(todo):
            mid = 0.5 * (lo + hi)
            gm = g(mid)
            same = np.sign(gm) == np.sign(glo)
            lo = np.where(same, mid, lo)
            glo = np.where(same, gm, glo)
            hi = np.where(same, hi, mid)
        done += todo
        with np.errstate(invalid="ignore"):
            wide = np.abs(hi - lo) > 1e-12 * np.maximum(1.0, np.abs(0.5 * (lo + hi)))
        if done >= BISECT_MAX_ITER or not np.any(wide):
            return 0.5 * (lo + hi)
        todo = min(64, BISECT_MAX_ITER - done)


def panel_rule(logf, breaks, step):
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
    # and on to 2^-12 of the row's length scale where 2^-24 of the segment is coarser: a segment 1e12
    # wide (a logistic mode at −1e12, the next break at the factor's bend near 0) left the panels
    # 6e4 wide around a peak of width 1 (found by an audit: N(−1e12+0.2, 0.36) for N(−1e12+1, 1));
    # panel ends a 2^-12 of the peak's width off cost the Gauss–Legendre panels nothing
    with np.errstate(divide="ignore", invalid="ignore"):
        extra = np.ceil(np.log2((hi - lo) / np.maximum(step, 1e-300)[ib])) - (_BISECT_LEVEL - _BISECT_SCALE)
    need = _BISECT_LEVEL + np.where(np.isfinite(extra), np.maximum(extra, 0.0), 0.0)
    for _ in range(_BISECT_LEVEL):
        mid = 0.5 * (lo + hi)
        same = np.sign(logf(mid, ib) - tgt) == sign_lo
        lo = np.where(same, mid, lo)
        hi = np.where(same, hi, mid)
    wide = np.flatnonzero(need > _BISECT_LEVEL)  # (only these go on: the others end as before)
    if wide.size:
        wlo, whi, wib, wtgt, wsign = lo[wide], hi[wide], ib[wide], tgt[wide], sign_lo[wide]
        wneed = need[wide]
        for it in range(_BISECT_LEVEL, int(min(wneed.max(), BISECT_MAX_ITER))):
            mid = 0.5 * (wlo + whi)
            same = np.sign(logf(mid, wib) - wtgt) == wsign
            go = it < wneed
            wlo = np.where(same & go, mid, wlo)
            whi = np.where(~same & go, mid, whi)
        lo[wide], hi[wide] = wlo, whi
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
    # normalised from the offsets to the largest: ``lw - log_z`` rounds log_z to ulp(|m|), an error
    # common to every weight — at |log f| ~ 1e9…1e12 the weights summed to 1 ± 1e-4, which moved
    # a mean of 1000 by a fifth of its sd (found by an audit; the moment sums assume Σw = 1)
    return t, (lw - m) - np.log(s), log_z


# the logistic's bends: fixed split points so no panel straddles the transition of σ
def weighted_mean_var(t, lw):
    w = np.exp(lw)
    mean = np.sum(w * t, axis=1)
    var = np.sum(w * (t - mean[:, None]) ** 2, axis=1)
    return mean, var


LOG_SQRT_2PI = 0.5 * np.log(2 * np.pi)


def lower_truncated_excess(alpha, n_terms: int = 80):
    """(λ − α, variance) of N(0, 1) truncated to [α, ∞), λ its mean, accurate in the far tail: a
    truncated Gaussian's mean μ + s λ(−μ/s) is s·(λ − α) at α = −μ/s, which a cavity far on the other
    side needs without the cancellation of λ − α (found by an audit: the probit belief's mean 0 for
    −2e-30, KL 0.5).

    For α < 5: λ = φ(α)/Φ(−α) and var = 1 − λ(λ − α) (mild cancellation).  For α ≥ 5 the
    Mills-ratio continued fraction R = 1/(α + c), c = 1/(α + d), d = 2/(α + 3/(α + …)) gives
    λ − α = c and var = c² (α d + d² − 1) with no cancellation (var ≈ 1/α² for large α); the
    continued fraction is evaluated only on the tail entries.
    """
    alpha = np.asarray(alpha, float)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        lam = np.exp(-0.5 * alpha * alpha - LOG_SQRT_2PI - special.log_ndtr(-alpha))
        excess = lam - alpha
        var = 1.0 - lam * excess
    tail = alpha >= 5.0
    if np.any(tail):
        a = alpha[tail]
        t = np.zeros_like(a)
        for k in range(n_terms, 1, -1):
            t = k / (a + t)
        c = 1.0 / (a + t)
        excess = np.array(excess, dtype=float, copy=True)
        var = np.array(var, dtype=float, copy=True)
        excess[tail] = c
        var[tail] = c * c * (a * t + t * t - 1.0)
    return excess, np.maximum(var, 0.0)


def two_piece_moments(mu, v, log_c_pos, log_c_neg):
    """Tilted moments of ``N(f; mu, v) · [c₊ Θ(f) + c₋ Θ(−f)]`` (log weights; −inf allowed).

    Returns ``(log Z, mean, var, π₊)`` with π₊ the tilted mass of ``f > 0``.  Each piece is a
    truncated Gaussian; its moments come from :func:`lower_truncated_excess` (accurate in the far
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
    # the pieces' means μ + sλ(−z) and μ − sλ(z), as s·(λ(−z) − (−z)) and −s·(λ(z) − z): no cancellation
    # where a piece lies far on the other side of 0 from μ
    ex_p, tv_p = lower_truncated_excess(-z)
    ex_n, tv_n = lower_truncated_excess(z)
    m_pos = s * ex_p
    m_neg = -s * ex_n
    with np.errstate(invalid="ignore"):
        mean = np.where(pi_neg == 0, m_pos, np.where(pi_pos == 0, m_neg, pi_pos * m_pos + pi_neg * m_neg))
        d_pos = np.where(pi_pos > 0, v * tv_p + (m_pos - mean) ** 2, 0.0)
        d_neg = np.where(pi_neg > 0, v * tv_n + (m_neg - mean) ** 2, 0.0)
        var = pi_pos * d_pos + pi_neg * d_neg
    return log_z, mean, var, pi_pos


def gaussian_kl(m1, v1, m2, v2):
    """KL(N(m1, v1) ‖ N(m2, v2)), elementwise."""
    r = v1 / v2
    return 0.5 * (r - 1.0 - np.log(r) + (m1 - m2) ** 2 / v2)
