"""The probit factor with label noise p(y | f) = ε + (1 − 2ε) Θ(y f), y ∈ {−1, +1}, and everything
specific to it.

f Gaussian, y Bernoulli (an observed label is Bernoulli with p = 0 or 1).  The tilted
distribution is a two-piece truncated Gaussian, so every rule is closed form; ``f^u`` is again a
two-piece step — weight ``(1 − ε)^u`` where ``y f > 0`` and ``ε^u`` where ``y f < 0`` (relaxed-EP
appendix §4, eq. 27) — so power EP stays closed form too.  For a soft label message
``Bernoulli(p)`` the weights are ``p (1−ε)^u + (1−p) ε^u`` (f > 0) and ``p ε^u + (1−p)(1−ε)^u``.

* :class:`ProbitNoise` with its exact rules (to ``f`` with power, to ``y``, the direct message to
  ``y`` — the likelihood —, the log partition with power) and default training distribution
  (:func:`probit_incoming`); trainable by default as ``probit_noise-f``, not served by default;
* :class:`ProbitNoiseOperator`: the same closed form for the EP engine, with a one-site float
  fast path and relaxed EP's ``projection_kl``.

Laplace propagation does not apply: ``log(ε + (1 − 2ε) Θ(y f))`` is piecewise constant.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
from scipy import special

from ..errors import gaussian_or_error
from ..families import Bernoulli, Family, Gaussian
from ..protocols import Operator
from ..quadrature import LOG_SQRT_2PI, gaussian_kl, two_piece_moments
from .base import (Factor, FactorParamError, broadcast_messages, check_power, message_rule, number_param, partition,
                   register_factor, rule)

__all__ = ["ProbitNoise", "ProbitNoiseOperator", "probit_incoming", "probit_log_weights", "probit_label_likelihood"]

_NOT_SMOOTH = (
    "Laplace propagation needs a twice-differentiable log factor; ProbitNoise's "
    "log(ε + (1−2ε)Θ(y f)) is piecewise constant with a jump at f = 0 (−∞ on a half-line for "
    "ε = 0): its derivatives vanish wherever they exist, so the Laplace approximation carries no "
    "information. Use ProbitNoiseOperator (closed-form EP) instead."
)


def _label_posterior(p, eps, log_phi_pos, log_phi_neg):
    """P(y = +1 | f) ∝ p (ε + (1 − 2ε) Φ(z)) against (1 − p)(ε + (1 − 2ε) Φ(−z)), in logs (``log_phi_*``:
    log Φ(±z)): a hard label the cavity contradicts (p = 1, Φ(z) underflowed) was 0/0 = NaN where the
    answer is the label itself (found by an audit)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        le = np.log(eps) if eps > 0 else -np.inf
        l12 = np.log1p(-2.0 * eps)
        lpos = np.log(p) + np.logaddexp(le, l12 + log_phi_pos)
        lneg = np.log1p(-p) + np.logaddexp(le, l12 + log_phi_neg)
        return special.expit(lpos - lneg)


class ProbitNoise(Factor):
    """Probit with label noise: p(y | f) = ε + (1 − 2ε) Θ(y f), y ∈ {−1, +1}."""

    name = "probit_noise"
    inputs = ("f",)
    output = "y"
    families = {"f": Gaussian, "y": Bernoulli}
    # trainable by default (`probit_noise-f`), not served by default
    default_untrainable = {"y": "its default y messages are observed labels, Bernoulli(0) or Bernoulli(1), whose "
                                "regression coordinates (log-odds) are infinite; y's exact rule is closed form"}

    @staticmethod
    def default_incoming(n, rng):
        return probit_incoming(n, rng)

    def __init__(self, eps: float = 0.0):
        if not (np.isfinite(number_param("ProbitNoise", "eps", eps)) and 0.0 <= eps < 0.5):
            raise FactorParamError("eps", f"ProbitNoise: `eps` must lie in [0, 0.5), got {eps!r}")
        self.eps = float(eps)

    def params(self):
        return {"eps": self.eps}

    def laplace_log_density(self):
        raise ValueError(_NOT_SMOOTH)

    def log_concave(self, to, incoming):
        # Θ(y f) is the indicator of a half-line (log-concave) for a known label (p ∈ {0, 1});
        # with label noise ε > 0, or a soft label message 0 < p < 1, the factor integrated
        # against the label is a two-level step p Θ(f) + (1 − p) Θ(−f), which is not (its
        # belief can be several times wider than the cavity)
        if to != "f" or self.eps > 0.0:
            return None
        p = np.asarray(incoming["y"].p, dtype=float)
        return np.broadcast_to((p == 0.0) | (p == 1.0), incoming["f"].shape)

    def symmetry(self, incoming):
        # f -> f/s leaves Θ(y f) unchanged: the frame gives f's message unit variance
        return {"f": (1.0 / np.sqrt(incoming["f"].var()), 0.0)}

    def sample(self, inputs, size, rng):
        y = np.where(inputs["f"] >= 0, 1.0, -1.0)
        flip = rng.random(size) < self.eps
        return np.where(flip, -y, y)

    # ------------------------------------------------------------------ exact rules
    def _tilted(self, incoming, power):
        fm, y = incoming["f"], incoming["y"]
        if power == 1.0:
            return _probit_moments(fm.mean(), fm.var(), y.p, self.eps)
        lcp, lcn = probit_log_weights(y.p, self.eps, power)
        log_z, mean, var, _ = two_piece_moments(fm.mean(), fm.var(), lcp, lcn)
        return log_z, mean, var, None

    @rule("f", power=True)
    def _belief_f(self, incoming, to, power):
        _, mean, var, _ = self._tilted(incoming, power)
        return gaussian_or_error(mean, var, "probit belief on f (cavity far in the tail)")

    @rule("y")
    def _belief_y(self, incoming, to, power):
        return Bernoulli(self._tilted(incoming, 1.0)[3])

    @message_rule("y")
    def _message_y(self, incoming, to):
        # the message to the label is the likelihood itself; computing it as q / m_y would give
        # inf − inf for an observed label (p = 0 or 1)
        return Bernoulli(probit_label_likelihood(incoming["f"], self.eps))

    @partition(power=True)
    def _log_partition(self, incoming, power):
        return self._tilted(incoming, power)[0]



def probit_log_weights(p, eps, u):
    """log c₊, log c₋ of the powered factor: c₊ = p (1−ε)^u + (1−p) ε^u, c₋ = p ε^u + (1−p) (1−ε)^u."""
    with np.errstate(divide="ignore"):
        l1, l0 = u * np.log1p(-eps), (u * np.log(eps) if eps > 0 else -np.inf)
        lp, lq = np.log(p), np.log1p(-p)
    return np.logaddexp(lp + l1, lq + l0), np.logaddexp(lp + l0, lq + l1)


def probit_label_likelihood(g: Gaussian, eps: float):
    """P(y = +1) of the normalised likelihood message to the label from a Gaussian message on f."""
    z = g.mean() / np.sqrt(g.var())
    like_pos = eps + (1 - 2 * eps) * special.ndtr(z)
    like_neg = eps + (1 - 2 * eps) * special.ndtr(-z)
    return like_pos / (like_pos + like_neg)


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


def probit_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    """Default training distribution: f-message as the logistic x-message (N(μ, v), μ ~ U(−10, 10),
    log10 v ~ U(−2, 1.5)); y-message the observed label Bernoulli(0 or 1), each with probability ½."""
    y = rng.random(n) < 0.5
    f = Gaussian(rng.uniform(-10.0, 10.0, n), 10.0 ** rng.uniform(-2.0, 1.5, n))
    return {"f": f, "y": Bernoulli(np.where(y, 1.0, 0.0))}


# ------------------------------------------------------------------ EP operator
def _lae(a: float, b: float) -> float:
    """log(e^a + e^b) for floats (−inf allowed)."""
    if a < b:
        a, b = b, a
    if a == -math.inf:
        return -math.inf
    return a + math.log1p(math.exp(b - a))


def _lower_truncated_excess_scalar(alpha: float) -> tuple[float, float]:
    """:func:`kjit.quadrature.lower_truncated_excess` for one float (same formulas)."""
    if alpha >= 5.0:
        t = 0.0
        for k in range(80, 1, -1):
            t = k / (alpha + t)
        c = 1.0 / (alpha + t)
        return c, max(c * c * (alpha * t + t * t - 1.0), 0.0)
    lam = math.exp(-0.5 * alpha * alpha - LOG_SQRT_2PI - float(special.log_ndtr(-alpha)))
    return lam - alpha, max(1.0 - lam * (lam - alpha), 0.0)


class ProbitNoiseOperator(Operator):
    """Closed-form operator for ``ProbitNoise(eps)`` (site variable ``'f'``, label ``'y'``).

    Supports power EP (``power=u``: factor ``f^u``, appendix §4) and relaxed EP
    (``projection_kl``).  ``factor`` is the :class:`ProbitNoise` instance, so
    :class:`kjit.ep.ProbitClassifier` picks ``eps`` up from it.  Equal to
    ``QuadratureOracle(ProbitNoise(eps))`` at ``power = 1``.
    """

    supports_power = True
    has_log_partition = True
    has_projection_kl = True
    has_appendix_relaxed_q = True

    def __init__(self, eps: float = 0.0):
        self.factor = ProbitNoise(eps)
        self.eps = self.factor.eps

    def __repr__(self):
        return f"ProbitNoiseOperator(eps={self.eps})"

    def _log_weights(self, p, u):
        return probit_log_weights(p, self.eps, u)

    def tilted(self, incoming: Mapping[str, Family], power: float = 1.0):
        """``(log Z, mean, var, E_p[log f^u], P(y=+1 | tilted))`` for the batch, in its shape."""
        u = power if power == 1.0 else check_power(power)
        g, y = incoming.get("f"), incoming.get("y")
        if not isinstance(g, Gaussian) or not isinstance(y, Bernoulli):
            raise ValueError("ProbitNoiseOperator needs a Gaussian message on 'f' and a Bernoulli message on 'y'")
        if g.shape == y.shape and g.size == 1:  # one site (sequential EP): floats, ~10× less overhead
            shape = g.shape
            out = self._tilted_scalar(float(g.mean().flat[0]), float(g.var().flat[0]), float(y.p.flat[0]), u)
            return tuple(np.array(x).reshape(shape) for x in out)
        shape, (g, y) = broadcast_messages(incoming, ("f", "y"))
        mu, v, p = (np.asarray(a, float).reshape(-1) for a in (g.mean(), g.var(), y.p))
        lcp, lcn = self._log_weights(p, u)
        log_z, mean, var, pi_pos = two_piece_moments(mu, v, lcp, lcn)
        pi_neg = 1.0 - pi_pos
        with np.errstate(invalid="ignore"):
            e_log = np.where(pi_pos > 0, pi_pos * lcp, 0.0) + np.where(pi_neg > 0, pi_neg * lcn, 0.0)
        # posterior of the label (power 1): P(y=+1) ∝ p (ε + (1−2ε) Φ(z))
        eps = self.eps
        z = mu / np.sqrt(v)
        py = _label_posterior(p, eps, special.log_ndtr(z), special.log_ndtr(-z))
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
        ex_p, tv_p = _lower_truncated_excess_scalar(-z)
        ex_n, tv_n = _lower_truncated_excess_scalar(z)
        m_pos, m_neg = s * ex_p, -s * ex_n  # (as quadrature.two_piece_moments: no cancellation far out)
        if pi_neg == 0.0:
            mean = m_pos
        elif pi_pos == 0.0:
            mean = m_neg
        else:
            mean = pi_pos * m_pos + pi_neg * m_neg
        var = (pi_pos * (v * tv_p + (m_pos - mean) ** 2) if pi_pos > 0 else 0.0) + (
            pi_neg * (v * tv_n + (m_neg - mean) ** 2) if pi_neg > 0 else 0.0)
        e_log = (pi_pos * lcp if pi_pos > 0 else 0.0) + (pi_neg * lcn if pi_neg > 0 else 0.0)
        py = float(_label_posterior(np.float64(p), eps, np.float64(lzp), np.float64(lzn)))
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
            return Bernoulli(probit_label_likelihood(incoming["f"], self.eps))
        return super().message(incoming, to)

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

    def appendix_relaxed_q(self, incoming: Mapping[str, Family], b, site_mean, site_prec,
                           marginal_var) -> np.ndarray:
        """The relaxed-EP appendix's objective ``Q(b)`` (appendix §3, eq. 22 with eqs. 23–26)
        *exactly as written*, without its penalty ``c|b|``: the ``b``-line-search objective of the
        paper's GP algorithm (main text eqs. 14–23).

        ``incoming``: the *unrelaxed* cavity on ``'f'`` (``N(h^{\\i}, λ^{\\i})``) and a hard label
        on ``'y'``; ``b`` the relaxation precision (≥ 0); ``site_mean`` ``m_i`` (the relaxation's
        centre), ``site_prec`` ``1/v_i`` (the old site's precision, 0 for an untouched site) and
        ``marginal_var`` ``A_ii`` (the posterior marginal with the old site), all in ``f``
        coordinates, broadcast together.  The paper's formulas are in the label-absorbed
        coordinate ``g = y f`` (Minka's BPM); this maps means to it with ``y = ±1``.

        Terms, with the relaxed cavity (eqs. 16–17) ``λ̃ = 1/(1/λ^{\\i} + b)``,
        ``h̃^{\\i} = h^{\\i} − λ̃ b (h^{\\i} − m_i)``, ``z = h̃^{\\i}/√λ̃``, ``Ẑ = ε + (1−2ε)Φ(z)``, α
        (eq. 18), ``h̃ = h̃^{\\i} + λ̃ α`` (19), ``1/v_{i,b} = α h̃ / (λ̃ (1 − α h̃))`` (20),
        ``m_{i,b} = h̃ + v_{i,b} α`` (21), ``1/a^new = 1/A_ii + 1/v_{i,b} − 1/v_i`` (23–24),
        ``ã = 1/(1/a^new + b)`` (25), ``F = ã + h̃²`` (26)::

            Q = {[(1−ε)log(1−ε) − ε log ε] Φ(z) + ε log ε}/Ẑ + (F − h̃ m_{i,b})/(2 v_{i,b})
                − ½ log(1 + (b + 1/v_{i,b}) λ^{\\i}) + ½ log(b λ^{\\i} + 1)
                − ½ b (m_i² − 2 m_i h̃ + F) + ½ (m_i − h̃)² / (λ^{\\i} + 1/b) − log Ẑ

        (the last fraction is 0 at ``b = 0``).  The first term is ``E_p[log t_i]`` of the relaxed
        tilted ``p``, ``F`` is the second moment of ``proj p``, and the two logs sum to
        ``−½ log(λ̃ / var(proj p))`` — but the rest is *not* ``−KL(proj p ‖ r q^{\\i})``:
        ``(F − h̃ m_{i,b})/(2 v_{i,b}) = 0`` identically and, with ``ṽ = var(proj p)``::

            Q(b) = KL(p ‖ proj p) − ½ α h̃^{\\i} − ½ b ṽ − ½ b (m_i − h̃)² b λ^{\\i} / (1 + b λ^{\\i})

        (tests/test_rep_readings.py checks this against quadrature).  So even ``Q(0)`` is not the
        KL, and the ``−½ b ṽ`` term adds a slope ``−ṽ/2`` at ``b = 0`` that the relaxed KL does
        not have: the line search relaxes at ``c`` of the order of the tilted variance, where
        the relaxed KL would not.  ``a^new`` (the
        variance of §4.1's belief ``q̃ / r``) may be negative for a large ``b``; the formula is
        still evaluated as written (``ã`` is then still ``var(proj p)``).
        """
        g, y = incoming.get("f"), incoming.get("y")
        if not isinstance(g, Gaussian) or not isinstance(y, Bernoulli):
            raise ValueError("appendix_relaxed_q needs a Gaussian message on 'f' and a Bernoulli label on 'y'")
        p = np.asarray(y.p, float)
        if not np.all((p == 0.0) | (p == 1.0)):
            raise ValueError("appendix_relaxed_q needs hard labels (Bernoulli p = 0 or 1) on 'y'")
        eps = self.eps
        if not eps > 0:
            raise ValueError("appendix_relaxed_q needs eps > 0 (its first term has ε log ε)")
        sgn = np.where(p == 1.0, 1.0, -1.0)
        arrs = np.broadcast_arrays(np.asarray(g.mean(), float), np.asarray(g.var(), float), sgn,
                                   np.asarray(b, float), np.asarray(site_mean, float),
                                   np.asarray(site_prec, float), np.asarray(marginal_var, float))
        hc, lc, s, b, m, sp, a = (x.astype(float) for x in arrs)
        hc, m = s * hc, s * m  # label-absorbed coordinate g = y f
        with np.errstate(all="ignore"):
            lt = 1.0 / (1.0 / lc + b)                                          # (16)
            htc = hc - lt * b * (hc - m)                                       # (17)
            z = htc / np.sqrt(lt)
            phi = special.ndtr(z)
            zh = eps + (1.0 - 2.0 * eps) * phi
            alpha = (1.0 - 2.0 * eps) * np.exp(-0.5 * z * z - LOG_SQRT_2PI) / zh / np.sqrt(lt)  # (18)
            ht = htc + lt * alpha                                              # (19)
            pb = alpha * ht / (lt * (1.0 - alpha * ht))                        # 1/v_{i,b} (20)
            # m_{i,b} = h̃ + v_{i,b} α  (21), so h̃ m_{i,b} / v_{i,b} = h̃² / v_{i,b} + h̃ α
            anew = 1.0 / (1.0 / a + pb - sp)                                   # (23)–(24)
            at = 1.0 / (1.0 / anew + b)                                        # (25)
            F = at + ht * ht                                                   # (26)
            t1 = (((1 - eps) * np.log1p(-eps) - eps * np.log(eps)) * phi + eps * np.log(eps)) / zh
            t2 = 0.5 * pb * (F - ht * ht) - 0.5 * ht * alpha
            t3 = -0.5 * np.log1p((b + pb) * lc) + 0.5 * np.log1p(b * lc)
            t4 = -0.5 * b * (m * m - 2.0 * m * ht + F)
            t5 = np.where(b > 0, 0.5 * (m - ht) ** 2 * b / (b * lc + 1.0), 0.0)
            q = t1 + t2 + t3 + t4 + t5 - np.log(zh)
        return np.where(np.isfinite(q), q, np.nan)


register_factor(ProbitNoise)
