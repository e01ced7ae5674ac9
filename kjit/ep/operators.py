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
:class:`ProbitNoiseOperator` (closed form, power EP, relaxed EP) and :class:`LogisticOperator`
(quadrature, power EP through the label message) live with their factors
(:mod:`kjit.factors.probit_noise`, :mod:`kjit.factors.logistic`) and are re-exported here.

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

A factor passed to :class:`LaplaceOperator` gives its log density through
:meth:`kjit.factors.Factor.laplace_log_density` (or raises saying why it has none).  Custom log
densities: any object with ``site_var``, ``derivatives(x, observed) -> (ℓ, ℓ', ℓ'')``
(vectorised over a batch; ``observed`` maps the other variables to message batches).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..factors import Factor
from ..factors.base import broadcast_messages, check_power
from ..factors.logistic import LogisticLogDensity, LogisticOperator  # noqa: F401  (their home: the factor)
from ..factors.probit_noise import ProbitNoiseOperator  # noqa: F401
from ..families import Family, Gaussian
from ..protocols import Operator
from ..quadrature import gaussian_kl, two_piece_moments  # noqa: F401  (re-exported)

__all__ = [
    "ProbitNoiseOperator",
    "LogisticOperator",
    "LaplaceOperator",
    "LogisticLogDensity",
    "GaussianLogDensity",
    "two_piece_moments",
    "gaussian_kl",
]


# ============================================================================ Laplace
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


class LaplaceOperator(Operator):
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
    has_log_partition = True

    def __init__(self, log_density, max_iter: int = 100, tol: float = 1e-12):
        if isinstance(log_density, Factor):
            # the factor knows its own log density, or why it has none
            log_density = log_density.laplace_log_density()
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
        u = check_power(power)
        if to != self.site_var:
            raise ValueError(f"LaplaceOperator answers to={self.site_var!r} only, got {to!r}")
        names = list(incoming)
        shape, msgs = broadcast_messages(incoming, names)
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

    def log_partition(self, incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
        shape, m, v, u, x, val, g2, ok = self._mode(incoming, self.site_var, power)
        with np.errstate(all="ignore"):
            lz = val - 0.5 * np.log(2 * np.pi * v) + 0.5 * np.log(2 * np.pi / -g2)
        return np.where(ok, lz, np.nan).reshape(shape)
