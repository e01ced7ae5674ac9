"""The compound-gamma factor τ ~ Gamma(s2, rate=r), r ~ Gamma(s1, rate=r1), r integrated out.

A factor on τ alone (no inputs) sending Gamma messages to τ, with its exact rule (a level-panel
rule in log τ, :func:`compound_gamma_rule`), default training distribution
(:func:`compound_gamma_incoming`), default JIT threshold (−6, the KJIT paper's) and served
recipient (``tau``).
"""

from __future__ import annotations

import numpy as np
from scipy import special

from ..errors import OracleError
from ..exact._common import gamma_belief, gamma_exponent, gamma_normaliser, gamma_shift, log_gamma_ratio, raise_bad_rows
from ..families import Family, Gamma
from ..quadrature import bisect, panel_rule
from .base import Factor, FactorParamError, number_param, partition, register_factor, rule

__all__ = ["CompoundGamma", "compound_gamma_rule", "compound_gamma_incoming"]


class CompoundGamma(Factor):
    """τ ~ Gamma(s2, rate=r), r ~ Gamma(s1, rate=r1), with r integrated out.

    The marginal density is p(τ) = Γ(s1+s2)/(Γ(s1)Γ(s2)) r1^{s1} τ^{s2−1} (r1 + τ)^{−(s1+s2)}.
    Defaults (s1, r1, s2) = (1, 1, 1) are the KJIT paper's.
    """

    name = "compound_gamma"
    inputs = ()
    output = "tau"
    families = {"tau": Gamma}
    default_threshold = -6.0  # the KJIT paper's
    served = ("tau",)

    @staticmethod
    def default_incoming(n, rng):
        return compound_gamma_incoming(n, rng)

    def __init__(self, s1: float = 1.0, r1: float = 1.0, s2: float = 1.0):
        for n, v in (("s1", s1), ("r1", r1), ("s2", s2)):
            if not (np.isfinite(number_param("CompoundGamma", n, v)) and v > 0):
                raise FactorParamError(n, f"CompoundGamma: `{n}` must be finite and > 0, got {v!r}")
        self.s1, self.r1, self.s2 = float(s1), float(r1), float(s2)

    def params(self):
        return {"s1": self.s1, "r1": self.r1, "s2": self.s2}

    def sample(self, inputs, size, rng):
        r = rng.gamma(self.s1, 1.0 / self.r1, size=size)
        return rng.gamma(self.s2, 1.0 / r)

    def log_density(self, tau):
        tau = np.asarray(tau, dtype=float)
        s1, r1, s2 = self.s1, self.r1, self.s2
        return (
            special.gammaln(s1 + s2) - special.gammaln(s1) - special.gammaln(s2)
            + s1 * np.log(r1) + (s2 - 1.0) * np.log(tau) - (s1 + s2) * np.log(r1 + tau)
        )

    # ------------------------------------------------------------------ exact rules
    def _rule(self, incoming):
        tau = incoming["tau"]
        return compound_gamma_rule(self, tau.shape_param, tau.rate)

    @rule("tau")
    def _belief_tau(self, incoming, to, power):
        """The KL projection by :func:`~kjit.exact._common.gamma_belief` (as the other Gamma rules):
        log E[τ] − E[log τ] from centred node sums for a narrow tilted distribution — E[τ] and
        E[log τ] handed to Gamma.project apart lost it (~1/(2a)) to rounding: a Gamma(1e15, 1)
        message's belief had 3.5e13 for 1e15 as its shape (found by an audit); log E[τ] of a broad
        one by the rule of τ·(the message), Gamma(a + 1, b) — no e^u that overflows at a far node of
        zero weight (shapes ≲ 1e-6 were a bare ValueError)."""
        tau = incoming["tau"]
        a, b = np.asarray(tau.shape_param, float), np.asarray(tau.rate, float)
        u, lw, lz = compound_gamma_rule(self, a, b)

        def log_moment(k):  # log E[τ^k] = log Z(a + k) − log Z(a) + ln Γ(a + k) − ln Γ(a) − k ln b
            return compound_gamma_rule(self, a + k, b)[2] - lz + log_gamma_ratio(a, k) - k * np.log(b)

        return gamma_belief(self.name, u, lw, log_moment, "kl")

    @partition()
    def _log_partition(self, incoming, power):
        return self._rule(incoming)[2]


#: beyond this shape the τ message pins τ to ~1e-8 relative: the rule's nodes in log τ cannot resolve it
_MAX_SHAPE = 1e16
#: below this exponent of τ (s2 + shape − 1) the tilted density's mass spreads over ~1/exponent in log τ:
#: the belief's rate then drifts (1.4e-6 relative at 1e-10, 1.4e-5 at 1e-12, 30 % at 1e-16, measured
#: against its limit 2.4773776 at s2 = 1) — and the outgoing message's with it, by O(1)
_MIN_EXPONENT = 1e-10


def compound_gamma_rule(factor: "CompoundGamma", a, b):
    """Panel rule in u = log τ for r(τ) ∝ p_cg(τ) · Gamma(τ; a, b) (Jacobian e^u included)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    s1, r1, s2 = factor.s1, factor.r1, factor.s2
    # coefficient of u: τ^(s2−1) τ^(a−1) and the Jacobian dτ = τ du — (s2 − 1) + a, not s2 + a − 1,
    # which rounds to 0 for s2 = 1 and a < 1e-16 (refused as improper; found by an audit)
    c1 = (s2 - 1.0) + a
    narrow = a > _MAX_SHAPE
    if np.any(narrow):  # (as the other Gamma rules: see kjit.exact.gamma_rate)
        raise_bad_rows("compound_gamma", np.flatnonzero(narrow.ravel()), f"the τ message's shape exceeds "
                       f"{_MAX_SHAPE:g}: τ is known to ~1e-8, beyond what the rule resolves")
    if np.any(~(c1 > 0)):
        raise OracleError(
            "compound-gamma tilted distribution is improper: need s2 + shape - 1 > 0 "
            "(τ^(s2+a-2) is not integrable at 0)", rows=np.flatnonzero(~(c1 > 0).ravel())
        )
    spread = c1 < _MIN_EXPONENT
    if np.any(spread):
        raise_bad_rows("compound_gamma", np.flatnonzero(spread.ravel()), f"s2 + shape - 1 is below "
                       f"{_MIN_EXPONENT:g}: the tilted density's mass spreads over ~1/(s2 + shape - 1) in log τ, "
                       f"beyond what the rule resolves")

    def col(p, t, rows):
        return p[rows] if rows is not None else p.reshape(p.shape + (1,) * (t.ndim - 1))

    # the message's exponent a u − b e^u about its mode, τ's other power (s2 − 1) apart: both ~a ln a for a
    # concentrated message, they cancelled against its normaliser (found by an audit: the evidence 3.5e-3
    # off at Gamma(1e12, 1e12)); gamma_normaliser gives the shift back
    u0 = gamma_shift(a, b)
    extra = np.full_like(a, s2 - 1.0)

    def logf(u, rows=None):
        aa, ee, uu = col(a, u, rows), col(extra, u, rows), col(u0, u, rows)
        return gamma_exponent(u, aa, uu, ee) - (s1 + s2) * np.logaddexp(np.log(r1), u)

    def dlogf(u):
        return c1 - (s1 + s2) * special.expit(u - np.log(r1)) - b * np.exp(u)

    u_hi = np.log(c1 / b) + 1.0
    u_lo = np.log(c1 / ((s1 + s2) / r1 + b)) - 1.0
    mode = bisect(dlogf, u_lo, u_hi, 200)
    curv = (s1 + s2) * special.expit(mode - np.log(r1)) * special.expit(np.log(r1) - mode) + b * np.exp(mode)
    step = 1.0 / np.sqrt(curv)
    t, lw, log_z = panel_rule(logf, mode[:, None], step)
    log_z = (
        log_z
        + special.gammaln(s1 + s2) - special.gammaln(s1) - special.gammaln(s2) + s1 * np.log(r1)
        + gamma_normaliser(a)
    )
    return t, lw, log_z


def compound_gamma_incoming(n: int, rng: np.random.Generator) -> dict[str, Family]:
    """Default training distribution: tau-message Gamma(a, b) with log10 a ~ U(0, 1.5) (a from 1
    to 31.6, the shape of a likelihood message from 0 to 60 Gaussian observations) and
    log10 b ~ U(−1, 1)."""
    return {"tau": Gamma(10.0 ** rng.uniform(0.0, 1.5, n), 10.0 ** rng.uniform(-1.0, 1.0, n))}


register_factor(CompoundGamma)
