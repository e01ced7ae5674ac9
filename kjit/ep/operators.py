"""Site operators for the EP variants: power EP, relaxed EP and Laplace propagation.

All follow the operator interface of :class:`kjit.ep.LinearEP` (``belief(incoming, to)``,
``log_partition(incoming)``, ``message``) and add what the variants need:

* ``belief(incoming, to, power=u)`` / ``log_partition(incoming, power=u)`` with
  ``supports_power = True``: the tilted distribution of the factor *to the power u* (power EP);
* ``projection_kl(incoming, to)``: ``KL(p ‖ proj p)`` of the tilted distribution ``p``, the
  quantity relaxed EP's line search minimises (plus ``c·b``);
* ``tilted(incoming, power)``: ``(log Z, mean, var, E_p[log f])`` in one pass.

Operators
---------
:class:`ProbitNoiseOperator` — ``p(y | f) = ε + (1 − 2ε) Θ(y f)`` (relaxed-EP paper eq. 10),
closed form.  ``f^u`` is again a two-piece step: weight ``(1 − ε)^u`` where ``y f > 0`` and ``ε^u``
where ``y f < 0`` (relaxed-EP appendix §4, eq. 27), so the power-u tilted distribution is a
two-piece truncated Gaussian and everything stays closed form.  For a soft label message
``Bernoulli(p)`` the weights are ``p (1−ε)^u + (1−p) ε^u`` (f > 0) and ``p ε^u + (1−p)(1−ε)^u``.

:class:`LogisticOperator` — the ``Logistic`` factor with a ``Beta(α, β)`` message on ``z``, by the
deterministic quadrature of :mod:`kjit.oracles`.  The effective likelihood on ``x`` is
``t(x) = σ(x)^(α−1) σ(−x)^(β−1) / B(α, β)``, so ``t^u`` is the same factor with the label message
``Beta(1 + u(α−1), 1 + u(β−1))`` — power EP costs nothing extra.

:class:`LaplaceOperator` — Laplace propagation (Smola, Vishwanathan & Eskin): the belief is the
Laplace approximation of the tilted distribution at its mode, ``N(x̂, −1/g''(x̂))`` with
``g(x) = log N(x; m, v) + u log t(x)``, found by a safeguarded 1-D Newton iteration.  A cheap
alternative operator, but only for factors with a **twice-differentiable log density** on the
site variable:

* ``Logistic`` qualifies (:class:`LogisticLogDensity`; log-concave when α + β ≥ 2, so the
  tilted log density is strictly concave and the mode unique);
* a Gaussian observation ``N(y; x, s²)`` qualifies (:class:`GaussianLogDensity`; the tilted
  distribution is Gaussian and Laplace propagation *is* EP);
* ``ProbitNoise`` does **not**: ``log(ε + (1 − 2ε) Θ(y f))`` is piecewise constant with a jump
  at ``f = 0`` (for ε = 0 it is −∞ on a half-line).  Its derivatives vanish wherever they exist,
  so the "Laplace approximation" is the cavity itself (no information) or undefined at the
  jump; use the closed-form :class:`ProbitNoiseOperator`.  (The smooth probit ``Φ(y f)`` would
  qualify, but it is a different factor.)
* ``CompoundGamma`` sends Gamma messages, not Gaussian sites: not an engine site factor.

Custom log densities: any object with ``site_var``, ``derivatives(x, observed) -> (ℓ, ℓ', ℓ'')``
(vectorised over a batch; ``observed`` maps the other variables to message batches).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
from scipy import special

from ..factors import Factor, Logistic, ProbitNoise
from ..families import Bernoulli, Beta, Family, Gaussian
from ..oracles import LOG_SQRT_2PI, logistic_tilted_rule, two_piece_moments

__all__ = [
    "ProbitNoiseOperator",
    "LogisticOperator",
    "LaplaceOperator",
    "LogisticLogDensity",
    "GaussianLogDensity",
    "two_piece_moments",
    "gaussian_kl",
]


def gaussian_kl(m1, v1, m2, v2):
    """KL(N(m1, v1) ‖ N(m2, v2)), elementwise."""
    r = v1 / v2
    return 0.5 * (r - 1.0 - np.log(r) + (m1 - m2) ** 2 / v2)


def _check_power(power) -> float:
    u = float(power)
    if not (np.isfinite(u) and u > 0):
        raise ValueError(f"`power` must be a finite number > 0, got {power!r}")
    return u


def _batch(incoming: Mapping[str, Family], names) -> tuple[tuple[int, ...], list[Family]]:
    missing = [n for n in names if n not in incoming]
    if missing:
        raise ValueError(f"incoming messages missing for {missing}")
    shape = np.broadcast_shapes(*(incoming[n].shape for n in names))
    return shape, [incoming[n].broadcast_to(shape) if incoming[n].shape != shape else incoming[n] for n in names]


# ============================================================================ probit
def _lae(a: float, b: float) -> float:
    """log(e^a + e^b) for floats (−inf allowed)."""
    if a < b:
        a, b = b, a
    if a == -math.inf:
        return -math.inf
    return a + math.log1p(math.exp(b - a))


def _lower_truncated_std_scalar(alpha: float) -> tuple[float, float]:
    """:func:`_lower_truncated_std` for one float (same formulas)."""
    if alpha >= 5.0:
        t = 0.0
        for k in range(80, 1, -1):
            t = k / (alpha + t)
        c = 1.0 / (alpha + t)
        return alpha + c, max(c * c * (alpha * t + t * t - 1.0), 0.0)
    lam = math.exp(-0.5 * alpha * alpha - LOG_SQRT_2PI - float(special.log_ndtr(-alpha)))
    return lam, max(1.0 - lam * (lam - alpha), 0.0)


class ProbitNoiseOperator:
    """Closed-form operator for ``ProbitNoise(eps)`` (site variable ``'f'``, label ``'y'``).

    Supports power EP (``power=u``: factor ``f^u``, appendix §4) and relaxed EP
    (``projection_kl``).  ``factor`` is the :class:`kjit.factors.ProbitNoise` instance, so
    :class:`kjit.ep.ProbitClassifier` picks ``eps`` up from it.  Equal to
    ``QuadratureOracle(ProbitNoise(eps))`` at ``power = 1``.
    """

    supports_power = True

    def __init__(self, eps: float = 0.0):
        self.factor = ProbitNoise(eps)
        self.eps = self.factor.eps

    def __repr__(self):
        return f"ProbitNoiseOperator(eps={self.eps})"

    def _log_weights(self, p, u):
        eps = self.eps
        with np.errstate(divide="ignore"):
            l1, l0 = u * np.log1p(-eps), (u * np.log(eps) if eps > 0 else -np.inf)
            lp, lq = np.log(p), np.log1p(-p)
        # c₊ = p (1−ε)^u + (1−p) ε^u,  c₋ = p ε^u + (1−p) (1−ε)^u
        return np.logaddexp(lp + l1, lq + l0), np.logaddexp(lp + l0, lq + l1)

    def tilted(self, incoming: Mapping[str, Family], power: float = 1.0):
        """``(log Z, mean, var, E_p[log f^u], P(y=+1 | tilted))`` for the batch, in its shape."""
        u = power if power == 1.0 else _check_power(power)
        g, y = incoming.get("f"), incoming.get("y")
        if not isinstance(g, Gaussian) or not isinstance(y, Bernoulli):
            raise ValueError("ProbitNoiseOperator needs a Gaussian message on 'f' and a Bernoulli message on 'y'")
        if g.shape == y.shape and g.size == 1:  # one site (sequential EP): floats, ~10× less overhead
            shape = g.shape
            out = self._tilted_scalar(float(g.mean().flat[0]), float(g.var().flat[0]), float(y.p.flat[0]), u)
            return tuple(np.array(x).reshape(shape) for x in out)
        shape, (g, y) = _batch(incoming, ("f", "y"))
        mu, v, p = (np.asarray(a, float).reshape(-1) for a in (g.mean(), g.var(), y.p))
        lcp, lcn = self._log_weights(p, u)
        log_z, mean, var, pi_pos = two_piece_moments(mu, v, lcp, lcn)
        pi_neg = 1.0 - pi_pos
        with np.errstate(invalid="ignore"):
            e_log = np.where(pi_pos > 0, pi_pos * lcp, 0.0) + np.where(pi_neg > 0, pi_neg * lcn, 0.0)
        # posterior of the label (power 1): P(y=+1) ∝ p (ε + (1−2ε) Φ(z))
        eps = self.eps
        z = mu / np.sqrt(v)
        like_pos = eps + (1 - 2 * eps) * special.ndtr(z)
        like_neg = eps + (1 - 2 * eps) * special.ndtr(-z)
        with np.errstate(invalid="ignore", divide="ignore"):
            py = p * like_pos / (p * like_pos + (1 - p) * like_neg)
        return tuple(a.reshape(shape) for a in (log_z, mean, var, e_log, py))

    def _tilted_scalar(self, mu, v, p, u):
        """:meth:`tilted` for one message (same formulas, floats)."""
        eps = self.eps
        nan = math.nan
        if not (math.isfinite(mu) and v > 0 and math.isfinite(v) and 0.0 <= p <= 1.0):
            return nan, nan, nan, nan, nan
        l1 = u * math.log1p(-eps)
        l0 = u * math.log(eps) if eps > 0 else -math.inf
        lp = math.log(p) if p > 0 else -math.inf
        lq = math.log1p(-p) if p < 1 else -math.inf
        lcp, lcn = _lae(lp + l1, lq + l0), _lae(lp + l0, lq + l1)
        s = math.sqrt(v)
        z = mu / s
        lzp, lzn = float(special.log_ndtr(z)), float(special.log_ndtr(-z))
        a, b = lcp + lzp, lcn + lzn
        log_z = _lae(a, b)
        pi_pos = math.exp(a - log_z) if a > -math.inf else 0.0
        pi_neg = math.exp(b - log_z) if b > -math.inf else 0.0
        lam_p, tv_p = _lower_truncated_std_scalar(-z)
        lam_n, tv_n = _lower_truncated_std_scalar(z)
        m_pos, m_neg = mu + s * lam_p, mu - s * lam_n
        if pi_neg == 0.0:
            mean = m_pos
        elif pi_pos == 0.0:
            mean = m_neg
        else:
            mean = pi_pos * m_pos + pi_neg * m_neg
        var = (pi_pos * (v * tv_p + (m_pos - mean) ** 2) if pi_pos > 0 else 0.0) + (
            pi_neg * (v * tv_n + (m_neg - mean) ** 2) if pi_neg > 0 else 0.0)
        e_log = (pi_pos * lcp if pi_pos > 0 else 0.0) + (pi_neg * lcn if pi_neg > 0 else 0.0)
        like_pos = eps + (1 - 2 * eps) * math.exp(lzp)
        like_neg = eps + (1 - 2 * eps) * math.exp(lzn)
        den = p * like_pos + (1 - p) * like_neg
        py = p * like_pos / den if den > 0 else nan
        return log_z, mean, var, e_log, py

    def belief(self, incoming: Mapping[str, Family], to: str, power: float = 1.0) -> Family:
        log_z, mean, var, _, py = self.tilted(incoming, power)
        if to == "f":
            return Gaussian._unchecked(mean, var)
        if to == "y":
            if float(power) != 1.0:
                raise ValueError("power EP messages to the label 'y' are not supported")
            return Bernoulli._unchecked(py)
        raise ValueError(f"ProbitNoiseOperator: unknown recipient {to!r} (expected 'f' or 'y')")

    def message(self, incoming: Mapping[str, Family], to: str) -> Family:
        if to == "y":
            g = incoming["f"]
            eps = self.eps
            z = g.mean() / np.sqrt(g.var())
            like_pos = eps + (1 - 2 * eps) * special.ndtr(z)
            like_neg = eps + (1 - 2 * eps) * special.ndtr(-z)
            return Bernoulli(like_pos / (like_pos + like_neg))
        return self.belief(incoming, to) / incoming[to]

    def log_partition(self, incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
        """``log ∫ N(f; m, v) Σ_y m(y) f(y | f)^u df``."""
        return self.tilted(incoming, power)[0]

    def projection_kl(self, incoming: Mapping[str, Family], to: str = "f", power: float = 1.0) -> np.ndarray:
        """``KL(p ‖ proj p)`` of the tilted ``p ∝ N(f; m, v) f^u``:
        ``E_p[log f^u] − log Z − KL(proj p ‖ N(m, v))`` (the relaxed-EP appendix eq. 22 without
        its penalty term)."""
        if to != "f":
            raise ValueError("projection_kl is defined for the site variable 'f'")
        g = incoming["f"]
        log_z, mean, var, e_log, _ = self.tilted(incoming, power)
        shape = log_z.shape
        mc = np.broadcast_to(g.mean(), shape)
        vc = np.broadcast_to(g.var(), shape)
        with np.errstate(all="ignore"):
            return e_log - log_z - gaussian_kl(mean, var, mc, vc)


# ============================================================================ logistic
class LogisticOperator:
    """``Logistic`` factor (site ``'x'``, label message ``Beta`` on ``'z'``) by quadrature, with
    power EP (label message raised to the power u) and ``projection_kl`` for relaxed EP.

    Uses the level-panel Gauss–Legendre rule of :class:`kjit.oracles.QuadratureOracle`, so at
    ``power = 1`` its beliefs equal that oracle's.
    """

    supports_power = True

    def __init__(self):
        self.factor = Logistic()

    def __repr__(self):
        return "LogisticOperator()"

    def _rule(self, incoming, power):
        u = _check_power(power)
        shape, (g, zmsg) = _batch(incoming, ("x", "z"))
        if not isinstance(g, Gaussian) or not isinstance(zmsg, Beta):
            raise ValueError("LogisticOperator needs a Gaussian message on 'x' and a Beta message on 'z'")
        m, v, a, b = (np.asarray(t, float).reshape(-1) for t in (g.mean(), g.var(), zmsg.alpha, zmsg.beta))
        au, bu = 1.0 + u * (a - 1.0), 1.0 + u * (b - 1.0)
        t, lw, log_z = logistic_tilted_rule(m, v, au, bu)
        # the rule's log Z is for N · Beta(σ(x); au, bu) = N · t^u · B(a,b)^u / B(au, bu)
        log_z = log_z + special.betaln(au, bu) - u * special.betaln(a, b)
        return shape, (m, v, a, b, u), t, lw, log_z

    def tilted(self, incoming: Mapping[str, Family], power: float = 1.0):
        """``(log Z, mean, var, E_p[log t^u])`` with ``t(x) = Beta(σ(x); α, β)``."""
        shape, (m, v, a, b, u), t, lw, log_z = self._rule(incoming, power)
        w = np.exp(lw)
        mean = np.sum(w * t, axis=1)
        var = np.sum(w * (t - mean[:, None]) ** 2, axis=1)
        log_t = -(a - 1.0)[:, None] * np.logaddexp(0.0, -t) - (b - 1.0)[:, None] * np.logaddexp(0.0, t)
        e_log = u * (np.sum(w * log_t, axis=1) - special.betaln(a, b))
        return tuple(x.reshape(shape) for x in (log_z, mean, var, e_log))

    def belief(self, incoming: Mapping[str, Family], to: str, power: float = 1.0) -> Family:
        if to != "x":
            raise ValueError("LogisticOperator answers to='x' only (use QuadratureOracle for 'z')")
        _, mean, var, _ = self.tilted(incoming, power)
        return Gaussian._unchecked(mean, var)

    def message(self, incoming: Mapping[str, Family], to: str) -> Family:
        return self.belief(incoming, to) / incoming[to]

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


# ============================================================================ Laplace
class LogisticLogDensity:
    """``log t(x) = (α−1) log σ(x) + (β−1) log σ(−x) − log B(α, β)`` for the ``Logistic``
    factor with label message ``Beta(α, β)`` on ``'z'``; smooth, log-concave for α + β ≥ 2."""

    site_var = "x"

    def __init__(self):
        self.factor = Logistic()

    def derivatives(self, x, observed):
        z = observed["z"]
        a, b = np.asarray(z.alpha, float), np.asarray(z.beta, float)
        sp, sn = special.expit(x), special.expit(-x)
        ell = -(a - 1.0) * np.logaddexp(0.0, -x) - (b - 1.0) * np.logaddexp(0.0, x) - special.betaln(a, b)
        d1 = (a - 1.0) * sn - (b - 1.0) * sp
        d2 = -(a + b - 2.0) * sp * sn
        return ell, d1, d2


class GaussianLogDensity:
    """``log N(y; x, s²)`` with the observation carried as the message ``Gaussian(y, s²)`` on
    ``obs_var`` (default ``'y'``): the conjugate case, on which Laplace propagation is exact EP."""

    site_var = "x"

    def __init__(self, obs_var: str = "y", site_var: str = "x"):
        self.obs_var = obs_var
        self.site_var = site_var
        self.factor = None

    def derivatives(self, x, observed):
        o = observed[self.obs_var]
        y, s2 = np.asarray(o.mean(), float), np.asarray(o.var(), float)
        ell = -0.5 * np.log(2 * np.pi * s2) - 0.5 * (y - x) ** 2 / s2
        return ell, (y - x) / s2, np.broadcast_to(-1.0 / s2, np.shape(ell))


_NOT_SMOOTH = (
    "Laplace propagation needs a twice-differentiable log factor; ProbitNoise's "
    "log(ε + (1−2ε)Θ(y f)) is piecewise constant with a jump at f = 0 (−∞ on a half-line for "
    "ε = 0): its derivatives vanish wherever they exist, so the Laplace approximation carries no "
    "information. Use ProbitNoiseOperator (closed-form EP) instead."
)


class LaplaceOperator:
    """Laplace propagation: belief = Laplace approximation of the tilted distribution at its mode.

    ``LaplaceOperator(Logistic())`` or ``LaplaceOperator(log_density)`` with a log-density object
    (see the module docstring for which factors qualify; ``ProbitNoise`` raises).

    For a cavity ``N(m, v)`` and power u the tilted log density is
    ``g(x) = −(x−m)²/(2v) + u ℓ(x)``; Newton's method from ``x = m`` with backtracking (a
    gradient step of length ``v·g'`` where ``g'' ≥ 0``) finds the mode ``x̂`` to ``tol``; the
    belief is ``N(x̂, −1/g''(x̂))``.  Where ``g''(x̂) ≥ 0`` (non-log-concave factor, no proper
    Laplace approximation) or Newton fails, the belief has a NaN variance and the engine skips
    that update (``invalid``).  ``log_partition`` is the Laplace estimate
    ``g(x̂) − ½ log(2πv) + ½ log(2π / −g''(x̂))`` (ℓ normalised as the factor's density).

    At a fixed point of EP with this operator each site matches ``ℓ'`` and ``ℓ''`` at the
    posterior mean, which is therefore a stationary point of the log posterior (the MAP; the
    paper's Lemma 1).
    """

    supports_power = True

    def __init__(self, log_density, max_iter: int = 100, tol: float = 1e-12):
        if isinstance(log_density, ProbitNoise):
            raise ValueError(_NOT_SMOOTH)
        if isinstance(log_density, Logistic):
            log_density = LogisticLogDensity()
        elif isinstance(log_density, Factor):
            raise ValueError(
                f"no log density is known for factor {log_density.name!r}: pass an object with "
                "site_var and derivatives(x, observed) -> (log f, d/dx, d²/dx²)"
            )
        if not hasattr(log_density, "derivatives"):
            raise ValueError("`log_density` must have derivatives(x, observed) -> (ℓ, ℓ', ℓ'')")
        self.log_density = log_density
        self.factor = getattr(log_density, "factor", None)
        self.site_var = getattr(log_density, "site_var", "x")
        self.max_iter = int(max_iter)
        self.tol = float(tol)

    def __repr__(self):
        return f"LaplaceOperator({type(self.log_density).__name__}())"

    def _mode(self, incoming, to, power):
        u = _check_power(power)
        if to != self.site_var:
            raise ValueError(f"LaplaceOperator answers to={self.site_var!r} only, got {to!r}")
        names = list(incoming)
        shape, msgs = _batch(incoming, names)
        inc = {n: mm.reshape(-1) for n, mm in zip(names, msgs)}
        g = inc.pop(to)
        m, v = np.asarray(g.mean(), float), np.asarray(g.var(), float)
        dens = self.log_density

        def evaluate(x, rows=None):
            obs = inc if rows is None else {k: mm[rows] for k, mm in inc.items()}
            mm_, vv = (m, v) if rows is None else (m[rows], v[rows])
            ell, d1, d2 = dens.derivatives(x, obs)
            val = -0.5 * (x - mm_) ** 2 / vv + u * ell
            return val, -(x - mm_) / vv + u * d1, -1.0 / vv + u * d2

        with np.errstate(all="ignore"):
            x = m.copy()
            val, g1, g2 = evaluate(x)
            active = np.isfinite(val) & np.isfinite(g1) & np.isfinite(g2)
            done = np.zeros(x.shape, bool)
            conv = np.zeros(x.shape, bool)
            for _ in range(self.max_iter):
                rows = np.flatnonzero(active & ~done)
                if rows.size == 0:
                    break
                step = np.where(g2[rows] < 0, -g1[rows] / g2[rows], v[rows] * g1[rows])
                t = np.ones(rows.size)
                acc = np.zeros(rows.size, bool)
                for _bt in range(60):
                    xn = x[rows] + t * step
                    vn, g1n, g2n = evaluate(xn, rows)
                    good = np.isfinite(vn) & (vn >= val[rows] - 1e-12 * np.abs(val[rows]))
                    newly = good & ~acc
                    if newly.any():
                        r = rows[newly]
                        x[r], val[r], g1[r], g2[r] = xn[newly], vn[newly], g1n[newly], g2n[newly]
                    acc |= good
                    if acc.all():
                        break
                    t = np.where(acc, t, 0.5 * t)
                moved = np.abs(t * step)
                small = acc & (moved <= self.tol * (1.0 + np.abs(x[rows])) + 1e-300)
                conv[rows] = small
                done[rows] = small | ~acc
        ok = conv & (g2 < 0) & np.isfinite(x)
        return shape, m, v, u, x, val, g2, ok

    def belief(self, incoming: Mapping[str, Family], to: str, power: float = 1.0) -> Family:
        shape, m, v, u, x, val, g2, ok = self._mode(incoming, to, power)
        with np.errstate(all="ignore"):
            var = np.where(ok, -1.0 / g2, np.nan)
        return Gaussian._unchecked(x.reshape(shape), var.reshape(shape))

    def message(self, incoming: Mapping[str, Family], to: str) -> Family:
        return self.belief(incoming, to) / incoming[to]

    def log_partition(self, incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
        shape, m, v, u, x, val, g2, ok = self._mode(incoming, self.site_var, power)
        with np.errstate(all="ignore"):
            lz = val - 0.5 * np.log(2 * np.pi * v) + 0.5 * np.log(2 * np.pi / -g2)
        return np.where(ok, lz, np.nan).reshape(shape)
