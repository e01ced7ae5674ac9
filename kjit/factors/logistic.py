"""The logistic factor z = σ(x) (x Gaussian, z Beta) and everything specific to it.

* :class:`Logistic` — the factor, with its exact rules: to ``x`` (with power: ``σ^u``-powered
  tilted distribution, i.e. the label message ``Beta(1 + u(α−1), 1 + u(β−1))``), to ``z`` (the
  KL projection onto Beta from E[log σ(±x)], each integral with its own panels) and the log
  partition (with power) — by the level-panel Gauss–Legendre rule :func:`logistic_tilted_rule`;
* its default training distribution :func:`logistic_incoming`, default JIT threshold (−8.95,
  the KJIT paper's) and served recipients (``x`` and ``z``);
* :class:`LogisticOperator` (power EP and relaxed EP's ``projection_kl`` for the engine) and
  :class:`LogisticLogDensity` (Laplace propagation).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
from scipy import special

from ..errors import OracleError, gaussian_or_error
from ..families import Beta, Family, Gaussian, beta_concentrated, beta_log_pdf_logit, log_beta
from ..protocols import Operator
from ..quadrature import bisect, gaussian_kl, panel_rule, weighted_mean_var
from .base import (GH_NODES, MAX_LOG_PARAM, Factor, as_shape, broadcast_messages, check_power, gauss_hermite,
                   gauss_hermite_log_base, gaussian_from_nodes, partition, register_factor, rule, tilted_laplace)

__all__ = ["Logistic", "logistic_tilted_rule", "log_label_density", "logistic_laplace_limit", "logistic_incoming", "LogisticOperator",
           "LogisticLogDensity"]


# the logistic's bends: fixed split points so no panel straddles the transition of σ
_LOGISTIC_BENDS = np.array([-6.0, -3.0, -1.5, 0.0, 1.5, 3.0, 6.0])


def log_label_density(t, alpha, beta):
    """``ℓ(t) = log Beta(σ(t); α, β)``: the logistic factor's log likelihood of ``x = t`` under the label
    message Beta(α, β) on z — :func:`kjit.families.beta_log_pdf_logit` (formed about its mode where the
    message is concentrated); broadcasts."""
    return beta_log_pdf_logit(t, alpha, beta)


def logistic_tilted_rule(mu, v, alpha, beta, weight: int = 0, power: float = 1.0, relative: bool = False):
    """Panel rule for r(x) = N(x; mu, v) · t(x)^u with t(x) = Beta(σ(x); α, β) (log normaliser included).

    t^u ∝ σ(x)^(u(α−1)) σ(−x)^(u(β−1)), the label message Beta(1 + u(α−1), 1 + u(β−1)), normalised by
    B(α, β)^u — not by that Beta's own B, which is infinite where a powered parameter is 0 or a
    negative integer (found by an audit: log Z NaN at Beta(½, ½), power 2).  ``weight`` = +1 / −1
    multiplies the integrand by softplus(−x) = −log σ(x) / softplus(x) = −log σ(−x), so that
    E[log σ(±x)] is integrated with panels placed for its own integrand: relative accuracy even
    when the statistic lives in the far tail.  Rows whose label message is concentrated
    (:func:`log_label_density`) integrate u·ℓ formed about its mode, normaliser included.  ``relative``: log Z
    less −(r − mu)²/(2v), the cavity exponent's value at the rule's reference point r (the same for every
    ``weight``): ratios of these integrals keep their digits where that constant is huge (a mode ~2e8 cavity
    sds away: −2e16, whose ulp is 4).
    """
    mu, v, alpha0, beta0 = (np.asarray(p, float) for p in (mu, v, alpha, beta))
    alpha, beta = _powered(alpha0, beta0, power)
    am1, bm1 = alpha - 1.0, beta - 1.0
    big = beta_concentrated(alpha0, beta0)  # (label messages whose ℓ is formed about its mode)
    any_big = bool(np.any(big))
    ab = am1 + bm1

    def col(p, t, rows):
        return p[rows] if rows is not None else p.reshape(p.shape + (1,) * (t.ndim - 1))

    # the cavity's exponent −(t − mu)²/(2v) is formed about a reference point r (mu, then the tilted density's
    # mode): −(t − r)(t − r + 2(r − mu))/(2v), its constant −(r − mu)²/(2v) added to log Z at the end.  About mu,
    # a mode D cavity sds away carried a rounding of ~1e-16 D²/2 in every node's log weight (found in review:
    # N(2e14, 1e12) with the label Beta(1, 401), D ~ 2e8, put noise of O(1) on the weights and answered z with
    # the uniform Beta(1, 1))
    ref = {"r": mu}

    def quad(t, m, vv, r):
        d = t - r
        return -0.5 * d * (d + 2.0 * (r - m)) / vv

    def logf0(t, rows=None):
        m, vv, c, b1, r = (col(p, t, rows) for p in (mu, v, ab, bm1, ref["r"]))
        # (α−1) log σ(t) + (β−1) log σ(−t) = −(α+β−2) softplus(−t) − (β−1) t
        out = quad(t, m, vv, r) - c * np.logaddexp(0.0, -t) - b1 * t
        if any_big:  # u·ℓ about its mode, the normaliser included (log_label_density)
            a0, b0, bg = (np.broadcast_to(col(p, t, rows), out.shape) for p in (alpha0, beta0, big))
            tt, mm, vv, rr = (np.broadcast_to(p, out.shape)[bg] for p in (t, m, vv, r))
            out[bg] = quad(tt, mm, vv, rr) + power * beta_log_pdf_logit(tt, a0[bg], b0[bg])
        return out

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
    r1 = bisect(dlogf, far_lo, np.where(nonconcave, -t0, far_hi), 100)
    r3 = bisect(dlogf, np.where(nonconcave, t0, far_lo), far_hi, 100)
    r2 = bisect(dlogf, -t0, t0, 100)
    has1 = ~nonconcave | (g_m < 0)
    has3 = nonconcave & (g_p > 0)
    has2 = nonconcave & (g_m < 0) & (g_p > 0)
    anchor = np.where(has1, r1, np.where(has3, r3, r2))
    # (a root of the unweighted density's slope, the same for the weighted rules: their log Z less this one's is
    # then free of the two constants' rounding — each ~1e-16 (r − mu)²/(2v))
    if weight:
        r0 = bisect(dlogf0, far_lo, far_hi, 100)
    else:  # (r1 is that root where the density is concave: the same bisection, element by element)
        r0 = np.where(nonconcave, bisect(dlogf0, far_lo, far_hi, 100), r1) if np.any(nonconcave) else r1
    ref["r"] = np.where(np.isfinite(r0), r0, mu)
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
        roots = bisect(dg, flat_lo, flat_hi, 200).reshape(lo_.shape)
        breaks = np.concatenate([breaks, np.where(has, roots, anchor[:, None])], axis=1)
    # curvature scale at the main mode for the outward search
    curv = 1.0 / v + np.maximum(alpha + beta - 2.0, 0.0) * special.expit(anchor) * special.expit(-anchor)
    step = np.minimum(1.0 / np.sqrt(curv), np.sqrt(v))
    t, lw, log_z = panel_rule(logf, breaks, step)
    # the normaliser of N(x; mu, v) with the exponent's constant about the reference, and B(α, β)^u where ℓ was
    # not formed with it
    log_z = log_z - 0.5 * np.log(2 * np.pi * v)
    if not relative:
        log_z = log_z - 0.5 * (ref["r"] - mu) ** 2 / v
    if not any_big:
        return t, lw, log_z - power * log_beta(alpha0, beta0)
    return t, lw, log_z - np.where(big, 0.0, power * log_beta(np.where(big, 2.0, alpha0), beta0))


def _powered(alpha, beta, u):
    """The label message of ``t^u``: Beta(1 + u(α−1), 1 + u(β−1)) (itself at u = 1)."""
    if u == 1.0:
        return alpha, beta
    return 1.0 + u * (alpha - 1.0), 1.0 + u * (beta - 1.0)


class Logistic(Factor):
    """z = σ(x) = 1 / (1 + e^{−x}), deterministic.  x: Gaussian, z: Beta."""

    name = "logistic"
    inputs = ("x",)
    output = "z"
    families = {"x": Gaussian, "z": Beta}
    default_threshold = -8.95  # the KJIT paper's
    served = ("x", "z")

    @staticmethod
    def default_incoming(n, rng):
        return logistic_incoming(n, rng)

    def sample(self, inputs, size, rng):
        return special.expit(inputs["x"])

    #: 2: x by Gauss–Hermite quadrature on the Laplace approximation (2026-11-26), z unchanged;
    #: 1: Laplace's approximation for x
    approximation_revision = 2
    earlier_approximations = {1: "laplace_belief"}

    def approximate_belief(self, incoming, to):
        """The reference of a learned operator's relative targets.  x: the first two moments of the
        tilted density N(x; m, v)·σ(x)^{α−1}σ(−x)^{β−1} by Gauss–Hermite quadrature
        (:data:`~kjit.factors.base.GH_NODES` nodes) on :meth:`laplace_belief`'s Gaussian (adaptive
        quadrature; rows whose moments are not finite keep the Laplace answer).  z: the Laplace
        bridge of :meth:`laplace_belief` (unchanged).  Measured against the exact rule: see
        ``tests/test_factor_approximation.py``."""
        to = self.check_to(to)
        lap = self.laplace_belief(incoming, to)
        if to != "x":
            return lap
        xi = gauss_hermite(GH_NODES)[0]
        x, z = incoming["x"], incoming["z"]
        with np.errstate(all="ignore"):
            if lap.size == 1 and x.size == 1 and z.size == 1 and max(lap.ndim, x.ndim, z.ndim) <= 1:
                # one row (a served request): the per-row numbers as Python floats, where the batch
                # path has (1, 1) arrays — the same IEEE operations on them (√ correctly rounded in
                # both), so the same doubles; the nodes stay a (1, N) array
                m, v, a, b = x.mean().item(), x.var().item(), z.alpha.item(), z.beta.item()
                lv = lap.var().item()
                c, sd = lap.mean().item(), (math.sqrt(lv) if lv >= 0.0 else math.nan)
                xi = xi.reshape(1, -1)
            else:
                m, v = (np.asarray(p, dtype=float).ravel()[:, None] for p in (x.mean(), x.var()))
                a, b = (as_shape(p, lap.shape).ravel()[:, None] for p in (z.alpha, z.beta))
                c = np.asarray(lap.mean(), float).ravel()[:, None]
                sd = np.sqrt(np.asarray(lap.var(), float).ravel())[:, None]
            t = c + math.sqrt(2.0) * sd * xi  # (√2 correctly rounded, as np.sqrt)
            # log σ(t) = −softplus(−t), log σ(−t) = −softplus(t)
            lw = (gauss_hermite_log_base(GH_NODES) - 0.5 * (t - m) ** 2 / v
                  - (a - 1.0) * np.logaddexp(0.0, -t) - (b - 1.0) * np.logaddexp(0.0, t))
        return gaussian_from_nodes(lw, t, 0.0, lap)

    def laplace_belief(self, incoming, to):
        """Laplace's approximation of the tilted distribution in x, the reference of a learned
        operator's relative targets.

        With x's message N(m, v) and z's Beta(α, β) the tilted density of x is
        N(x; m, v)·σ(x)^{α−1} σ(−x)^{β−1} (:class:`LogisticLogDensity`; log-concave for
        α + β ≥ 2, which EP's labels give); its stationary point t* is found by
        :func:`tilted_laplace` in [m − vK, m + vK], K = max(|α − 1|, |β − 1|) (the log factor's
        slope is at most K), curvature h = 1/v + (α + β − 2) σ(t*) σ(−t*).  x: N(t*, 1/h), exact
        as α, β → 1 (the tilted density is then x's message).  z: the Laplace bridge of that Gaussian in logit
        space, Beta((1 + e^{t*})/s, (1 + e^{−t*})/s), s = 1/h — the Beta whose logit has mean
        log(α/β) = t* and variance ≈ 1/α + 1/β = s; closed form and proper for every finite t*,
        where projecting the logit-normal onto the Beta family by E log z, E log(1 − z) loses the
        Jensen gap to cancellation for extreme, narrow beliefs.  Measured on the factor suite's
        logistic-regression messages (5 000 pairs, D 125/250), mean log KL of the learned
        operator relative to it vs to the incoming message: x −23.69 vs −17.19, z −21.77 vs
        −8.26 (the approximations alone: −10.18, −4.22; the logit-normal's KL projection as z's
        reference: −20.64).
        """
        to = self.check_to(to)
        m, v = incoming["x"].mean(), incoming["x"].var()
        z = incoming["z"]
        a, b = np.asarray(z.alpha, dtype=float), np.asarray(z.beta, dtype=float)
        k = np.maximum(np.abs(a - 1.0), np.abs(b - 1.0))
        af, bf = a.ravel(), b.ravel()
        t, s = tilted_laplace(m, v, lambda t, i: LogisticLogDensity.slopes(t, af[i], bf[i]), m - v * k, m + v * k)
        if to == "x":
            return Gaussian._unchecked(t, s)
        # the Laplace bridge: the Beta whose logit has (asymptotically) mean t* and variance s; its
        # log parameters capped at MAX_LOG_PARAM (a label message Beta(α, β) with α + β < 2 can put the
        # stationary point of a broad message's tilted density near ±v: e^{t*} then overflows)
        with np.errstate(all="ignore"):
            log_s = np.log(s)
            log_a = np.minimum(np.logaddexp(0.0, t) - log_s, MAX_LOG_PARAM)
            log_b = np.minimum(np.logaddexp(0.0, -t) - log_s, MAX_LOG_PARAM)
        return Beta._unchecked(np.exp(log_a), np.exp(log_b))

    def suff_stats(self, var, draws):
        if var == "z":
            # (log σ(x), log σ(−x)) = −(softplus(−x), softplus(x)), softplus(t) = max(t, 0) +
            # log1p(e^−|t|): one exp and one log1p serve both (≈3× faster than two logaddexp,
            # the same values to an ulp; the importance-sampling oracle evaluates this per call)
            x = np.asarray(draws["x"], dtype=float)
            out = np.empty(x.shape + (2,))
            tail = np.log1p(np.exp(-np.abs(x)))
            np.negative(np.maximum(-x, 0.0) + tail, out=out[..., 0])
            np.negative(np.maximum(x, 0.0) + tail, out=out[..., 1])
            return out
        return super().suff_stats(var, draws)

    def laplace_log_density(self):
        return LogisticLogDensity()

    def log_concave(self, to, incoming):
        # the factor on x, z integrated against Beta(α, β): σ(x)^(α−1) σ(−x)^(β−1), log-concave
        # in x exactly when α ≥ 1 and β ≥ 1 (log σ is concave); the labels Beta(2,1)/(1,2) are
        if to != "x":
            return None
        z = incoming["z"]
        return (np.asarray(z.alpha) >= 1.0) & (np.asarray(z.beta) >= 1.0)

    # ------------------------------------------------------------------ exact rules
    @rule("x", power=True)
    def _belief_x(self, incoming, to, power):
        x, z = incoming["x"], incoming["z"]
        t, lw, _ = logistic_tilted_rule(x.mean(), x.var(), z.alpha, z.beta, power=power)
        mean, var = weighted_mean_var(t, lw)
        au, bu = _powered(z.alpha, z.beta, power)
        unresolved = _unresolved(mean, var)  # (the rule's own answer, before the limits replace it)
        mean, var = _logistic_point_mass_limit(x.mean(), x.var(), au, bu, mean, var)
        _refuse_unresolved(unresolved, "belief on x", exact=_laplace_exact(x.mean(), x.var(), au, bu))
        return gaussian_or_error(mean, var, "logistic belief on x")

    @rule("z")
    def _belief_z(self, incoming, to, power):
        x, z = incoming["x"], incoming["z"]
        args = (x.mean(), x.var(), z.alpha, z.beta)
        t, lw, log_z = logistic_tilted_rule(*args, relative=True)
        # E[log σ(x)] = −∫ r softplus(−x) / Z, each integral with its own panels (relative: their ratios)
        lz_neg = logistic_tilted_rule(*args, weight=+1, relative=True)[2]
        lz_pos = logistic_tilted_rule(*args, weight=-1, relative=True)[2]
        ess = np.stack([-np.exp(lz_neg - log_z), -np.exp(lz_pos - log_z)], axis=-1)
        # the Beta's concentration lives in the gap 1 − e^{E log z} − e^{E log(1−z)}; for a narrow x (~N(μ, v))
        # it is ≈ σ(μ)σ(−μ)·v while the statistics are O(1), known to a relative ~1e-14: refused where the
        # gap is too small against them to carry it (found by an audit: x ~ N(3, 1e-11) gave α 13 % off,
        # KL 4e-3; N(3, 1e-16) 98 %, KL 1.4).  (Far in a tail the gap is small with the statistic itself —
        # E log z ~ −β/α — and stays well determined.)
        with np.errstate(all="ignore"):
            e1, e2 = ess[..., 0], ess[..., 1]
            gap = -np.expm1(np.logaddexp(e1, e2))
            narrow = ~(gap > _Z_GAP * (np.exp(e1) * np.abs(e1) + np.exp(e2) * np.abs(e2)))
        # (and a tilted distribution the rule cannot resolve, whose statistics are no numbers at all:
        # :data:`_MAX_MEAN_SD`)
        narrow = narrow | _unresolved(*weighted_mean_var(t, lw)).reshape(narrow.shape)
        if np.any(narrow):
            bad = np.flatnonzero(narrow.ravel())
            raise OracleError(
                f"belief on z: x's message is too narrow for its Beta projection in double precision for rows "
                f"{bad[:10].tolist()}{'…' if bad.size > 10 else ''} (the gap 1 − exp E[log z] − exp E[log(1 − z)] "
                f"that carries the Beta's concentration is below {_Z_GAP:g} of the statistics)", rows=bad)
        if np.any(~(ess < 0)):
            bad = np.flatnonzero(~np.all(ess < 0, axis=1))
            raise OracleError(
                f"belief on z is numerically degenerate for rows {bad[:10].tolist()}: the tilted "
                "distribution sits within exp(-745) of z = 0 or 1, beyond double precision"
            )
        try:
            return Beta.project(ess)
        except ValueError as exc:
            raise OracleError(f"belief on z cannot be represented: {exc}") from None

    @partition(power=True)
    def _log_partition(self, incoming, power):
        x, z = incoming["x"], incoming["z"]
        t, lw, log_z = logistic_tilted_rule(x.mean(), x.var(), z.alpha, z.beta, power=power)
        _refuse_unresolved(_unresolved(*weighted_mean_var(t, lw)), "log partition")
        return log_z


# below this gap 1 − e^{E log z} − e^{E log(1 − z)} (≈ σ(μ)σ(−μ)·v for x ~ N(μ, v)), relative to the statistics
# (e^{E log z}|E log z| + e^{E log(1−z)}|E log(1−z)|), the belief on z is refused: its Beta's parameters
# carry a relative error ≈ 5e-14 / that ratio (α 3.3e-8 off at v = 1e-6 and μ = 3, 2.2e-5 at 1e-8 — accepted,
# KL 1.2e-10 — and 0.2 % at 1e-10, refused: measured against mpmath by the audit)
_Z_GAP = 5e-10

# below this v·(α + β + 1) the logistic belief on x is its second-order (Laplace) limit
_POINT_MASS = 1e-10


# beyond this many of its standard deviations from 0, the tilted distribution is not resolved by the panel
# rule: its nodes (its mode plus multiples of its width) lie a few ulp apart — its moments carry a relative
# error ~1e-16 times the ratio (measured: 7e-7 in the variance at 1e10, KL ~1e-13; 2.7e-6 at 2e11, a label
# Beta(3e22, 1e22) pinning x to log 3, answered — found in review; so ~1e-4 expected at 1e12, KL ~1e-9: the
# limit).  Read on the rule's own answer (the tilted mass can lie far from the cavity: a strong label pulls
# N(2e14, 1e12) back to N(0, 0.01)).  Found by an audit: N(1e15, 1)'s belief on x came out 0.125 sd off with a
# variance 1.8 % wide, N(1e30, 1)'s on z the uniform Beta(1, 1), log Z −4e55 for −1e30 — each an exact rule's
# answer, served with 200.
_MAX_MEAN_SD = 1e12
# σ is saturated over a Gaussian whose mass lies beyond this |x| (e^−40 ~ 4e-18 of curvature left)
_SATURATED = 40.0


def _unresolved(mean, var) -> np.ndarray:
    """Rows of a distribution of ``mean`` and ``var`` lying more than :data:`_MAX_MEAN_SD` of its standard
    deviations from 0 (or not numbers)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return ~(np.abs(np.asarray(mean, float)) <= _MAX_MEAN_SD * np.sqrt(np.asarray(var, float)))


def _refuse_unresolved(unresolved, what: str, exact=None) -> None:
    """An OracleError naming the ``unresolved`` rows (but those ``exact`` marks: answered otherwise)."""
    bad = np.asarray(unresolved, bool).ravel()
    if exact is not None:
        bad = bad & ~np.asarray(exact, bool).ravel()
    if np.any(bad):
        rows = np.flatnonzero(bad)
        raise OracleError(
            f"logistic {what}: the tilted distribution of rows {rows[:10].tolist()}{'…' if rows.size > 10 else ''} "
            f"lies more than {_MAX_MEAN_SD:g} of its standard deviations from 0, beyond what the rule's nodes "
            "resolve in double precision", rows=rows)


def _laplace_exact(mu, v, a, b) -> np.ndarray:
    """Rows where :func:`logistic_laplace_limit` is the tilted distribution (to double precision): the cavity
    is nearly a point mass on the factor's scale (v·(α+β+1) < 1e-10), or σ is saturated over the cavity
    N(mu, v) and over its shift N(mu + v l'(mu), v) alike, on one side of 0 — l(x) = (α−1) log σ(x) +
    (β−1) log σ(−x) is linear there, and N(x; mu, v)·e^{l(x)} that shifted Gaussian (a label that pulls the mass
    across 0 is no such case: found in review, N(2e14, 1e12) with Beta(1, 401) came out N(−2e14, 1e12)); the
    rule cannot resolve such a cavity beyond :data:`_MAX_MEAN_SD` of its sds, and needs not elsewhere."""
    mu, v = np.asarray(mu, float), np.asarray(v, float)
    a, b = np.asarray(a, float), np.asarray(b, float)
    # (the factor's scale from the sizes of its exponents: with power EP they can be negative, and
    # α + β + 1 ≤ 0 took every cavity for a point mass — found by an audit: variance 1000 for 3.12)
    pm = v * np.maximum(a + b + 1.0, np.abs(a - 1.0) + np.abs(b - 1.0) + 1.0) < _POINT_MASS
    with np.errstate(invalid="ignore", over="ignore"):
        sd = np.sqrt(v)
        shifted = mu + v * np.where(mu > 0, -(b - 1.0), a - 1.0)  # (l'(x) in σ's saturated tails)
        # (the curvature left, (α+β−2) e^{−|x|}, against a margin that grows with the exponents; and the far side's
        # exponent — σ(x)^(α−1) for mu > 0 — not negative: else e^{l} grows again beyond 0, a second mode that can
        # hold the mass, found in review: N(4500, 1e4) with Beta(0.05, 1) is N(−5000, 1e4))
        margin = _SATURATED + np.log1p(np.abs(a) + np.abs(b))
        saturated = ((np.abs(mu) - _SATURATED * sd > margin) & (np.abs(shifted) - _SATURATED * sd > margin)
                     & (np.sign(shifted) == np.sign(mu)) & (np.where(mu > 0, a, b) >= 1.0))
    return pm | saturated


def _logistic_point_mass_limit(mu, v, alpha, beta, mean, var):
    """Where the cavity N(mu, v) is nearly a point mass on the scale of the factor
    l(x) = (α−1) log σ(x) + (β−1) log σ(−x) (v·(α+β+1) < 1e-10), the tilted distribution is
    N(mu + v_q l'(mu), v_q), 1/v_q = 1/v − l''(mu), up to a relative O(v) in the variance (the
    next terms carry the third derivative of l); the panel rule there can underflow the variance
    to 0 (v ~ 1e-23) and loses the message precision 1/v_q − 1/v to round-off long before.  The same
    where σ is saturated over the cavity and its shift (:func:`_laplace_exact`)."""
    mu, v = np.asarray(mu, float), np.asarray(v, float)
    a, b = np.asarray(alpha, float), np.asarray(beta, float)
    pm = _laplace_exact(mu, v, a, b)
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


# ------------------------------------------------------------------ default training distribution
def _gaussian_default(n, rng):
    return Gaussian(rng.uniform(-10.0, 10.0, n), 10.0 ** rng.uniform(-2.0, 1.5, n))


def logistic_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    """The default training distribution of both directions (chosen from the cavities EP
    produces on the KJIT paper's UCI problems: cavity means in [−21, 11], 95 % within [−11, 6];
    variances in [0.03, 120], 90 % within [0.05, 27]; rows outside are what the just-in-time
    threshold sends to the oracle).

    x-message N(μ, v): μ ~ U(−10, 10), log10 v ~ U(−2, 1.5) (v from 0.01 to 31.6); z-message: the
    observed-label message Beta(2, 1) (y = 1) or Beta(1, 2) (y = 0), each with probability ½ — in
    logistic regression z is always observed.  (Mixing in latent-z Beta messages with α, β in
    [0.5, 10] made the x-operator 50× worse on the label messages.)
    """
    y = rng.random(n) < 0.5
    return {"x": _gaussian_default(n, rng), "z": Beta(np.where(y, 2.0, 1.0), np.where(y, 1.0, 2.0))}


# ------------------------------------------------------------------ EP operators
class LogisticOperator(Operator):
    """``Logistic`` factor (site ``'x'``, label message ``Beta`` on ``'z'``) by quadrature, with
    power EP (label message raised to the power u) and ``projection_kl`` for relaxed EP.

    Uses the factor's level-panel Gauss–Legendre rule, so at ``power = 1`` its beliefs equal
    those of ``QuadratureOracle(Logistic())``.
    """

    supports_power = True
    has_log_partition = True
    has_projection_kl = True

    def __init__(self):
        self.factor = Logistic()

    def __repr__(self):
        return "LogisticOperator()"

    def _rule(self, incoming, power):
        u = check_power(power)
        shape, (g, zmsg) = broadcast_messages(incoming, ("x", "z"))
        if not isinstance(g, Gaussian) or not isinstance(zmsg, Beta):
            raise ValueError("LogisticOperator needs a Gaussian message on 'x' and a Beta message on 'z'")
        m, v, a, b = (np.asarray(t, float).reshape(-1) for t in (g.mean(), g.var(), zmsg.alpha, zmsg.beta))
        t, lw, log_z = logistic_tilted_rule(m, v, a, b, power=u)
        # (QuadratureOracle answers a far cavity over which σ is saturated in closed form; the operator's log Z and
        # E log t come from the rule, so it refuses every row the rule cannot resolve)
        _refuse_unresolved(_unresolved(*weighted_mean_var(t, lw)), "operator")
        return shape, (m, v, a, b, u), t, lw, log_z

    def tilted(self, incoming: Mapping[str, Family], power: float = 1.0):
        """``(log Z, mean, var, E_p[log t^u])`` with ``t(x) = Beta(σ(x); α, β)``."""
        shape, (m, v, a, b, u), t, lw, log_z = self._rule(incoming, power)
        w = np.exp(lw)
        mean = np.sum(w * t, axis=1)
        var = np.sum(w * (t - mean[:, None]) ** 2, axis=1)
        e_log = u * np.sum(w * log_label_density(t, a[:, None], b[:, None]), axis=1)
        return tuple(x.reshape(shape) for x in (log_z, mean, var, e_log))

    def belief(self, incoming: Mapping[str, Family], to: str, power: float = 1.0) -> Family:
        if to != "x":
            raise ValueError("LogisticOperator answers to='x' only (use QuadratureOracle for 'z')")
        _, mean, var, _ = self.tilted(incoming, power)
        return Gaussian._unchecked(mean, var)

    def log_partition(self, incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
        return self.tilted(incoming, power)[0]

    def projection_kl(self, incoming: Mapping[str, Family], to: str = "x", power: float = 1.0) -> np.ndarray:
        if to != "x":
            raise ValueError("projection_kl is defined for the site variable 'x'")
        g = incoming["x"]
        log_z, mean, var, e_log = self.tilted(incoming, power)
        shape = log_z.shape
        with np.errstate(all="ignore"):
            return e_log - log_z - gaussian_kl(mean, var, np.broadcast_to(g.mean(), shape),
                                               np.broadcast_to(g.var(), shape))


class LogisticLogDensity:
    """``log t(x) = (α−1) log σ(x) + (β−1) log σ(−x) − log B(α, β)`` for the ``Logistic``
    factor with label message ``Beta(α, β)`` on ``'z'``; smooth, log-concave for α + β ≥ 2."""

    site_var = "x"

    def __init__(self):
        self.factor = Logistic()

    def derivatives(self, x, observed):
        z = observed["z"]
        a, b = np.asarray(z.alpha, float), np.asarray(z.beta, float)
        return (log_label_density(x, a, b), *self.slopes(x, a, b))

    @staticmethod
    def slopes(x, a, b):
        """``(d/dx, d²/dx²)`` of log t(x) for label message Beta(a, b)."""
        sp, sn = special.expit(x), special.expit(-x)
        return (a - 1.0) * sn - (b - 1.0) * sp, -(a + b - 2.0) * sp * sn


register_factor(Logistic)
