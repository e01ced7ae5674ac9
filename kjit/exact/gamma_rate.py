"""Exact EP rules of the ``gamma_rate`` factor: r (Gamma) → x ~ Gamma(shape, rate=r) (Gamma).

Incoming Gamma(r; a_r, b_r) and Gamma(x; a_x, b_x), fixed ``shape`` s, power α (α = 1 is EP).
The powered factor Gamma(x; s, r)^α = r^{αs} x^{α(s−1)} e^{−αrx} / Γ(s)^α keeps the
conjugate structure, so either variable integrates out in closed form:

* x out (x^{α(s−1)} x^{a_x−1} = x^{c−1}, c = α(s−1) + a_x):
  ∫ Gamma(x; s, r)^α Gamma(x; a_x, b_x) dx = Γ(s)^{−α} b_x^{a_x} Γ(c) / Γ(a_x) · r^{αs} (αr + b_x)^{−c},
  so w(r) ∝ Gamma(r; a_r, b_r) r^{αs} (αr + b_x)^{−c}   (α = 1: c = s + a_x − 1);
* r out: w(x) ∝ Gamma(x; a_x, b_x) x^{α(s−1)} (b_r + αx)^{−(αs + a_r)}.

Both are, in u = log of the variable, exp(A u − B e^u − C log(α e^u + K)) with A, B, C > 0 —
strictly concave in u, one mode, bracketed in [log(A / (B + Cα/K)), log(A / B)].  The tilted
distribution exists only if c > 0: for c <= 0 the x-integral diverges at x → 0 for every r
(an ``OracleError`` naming the rows).

Beliefs are Gamma: the KL projection (E[v], E[log v]) by default, mean and variance with
``projection="moments"`` (Infer.NET's convention for GammaFromShapeAndRate).  E[v^k] is the
same integral with A → A + k, integrated with its own panels when the tilted distribution is
broad.  Power EP is supported (any α > 0 with c > 0).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from scipy import special

from ..families import Family, Gamma
from ._common import (
    check_incoming,
    check_positive_param,
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
    is_empty,
    log_concave_mode,
    log_gamma_ratio,
    raise_bad_rows,
    rule,
)

NAME = "gamma_rate"
INPUTS = ("r",)
OUTPUT = "x"
FAMILIES = {"r": Gamma, "x": Gamma}
PARAMS = {"shape": 1.0}
SUPPORTS_POWER = True
_MAX_SHAPE = 1e16

__all__ = ["belief", "log_partition", "sample"]


def _rule(A0, extra, B, C, K, alpha, k: int = 0):
    """Panel rule in u for exp((A0 + e + k) u − B e^u − C log(α e^u + K)), e = ``extra``, integrated
    as exp(A0 u − B e^u − c + (e + k) u − C log(1 + α e^u / K)): c the message's exponent at its
    mode (:func:`~kjit.exact._common.gamma_shift`; A0 is the message's shape, the factor's power
    e and a moment's k kept apart — a shape plus a power is not representable beyond 1e16), and
    C log K taken out (each is ~a ln a for a concentrated message: they cancelled against the
    normalisers; found by an audit, the evidence 0.24 nats off at shape 1e14).  Returns
    (u, lw, raw log integral of that integrand); the integral asked for is raw + c − C log K."""
    Ak = A0 + extra + k  # (for the mode only)
    logB, logK, loga = np.log(B), np.log(K), np.log(alpha)
    u0 = gamma_shift(A0, B)
    ek = extra + k + np.zeros_like(A0)

    def logf(t, rows=None):
        aa, ee, cc, lk, uu = (col(p, t, rows) for p in (A0, ek, C, logK, u0))
        with np.errstate(over="ignore"):
            return gamma_exponent(t, aa, uu, ee) - cc * np.logaddexp(0.0, t + loga - lk)

    def dlogf(t, rows=None):
        aa, lb, cc, lk = (col(p, t, rows) for p in (Ak, logB, C, logK))
        with np.errstate(over="ignore"):
            return aa - np.exp(t + lb) - cc * special.expit(t + loga - lk)

    hi = np.log(Ak) - logB
    lo = np.log(Ak) - np.logaddexp(logB, np.log(C) + loga - logK)
    mode = log_concave_mode(dlogf, lo, hi)
    sig = special.expit(mode + loga - logK)
    step = 1.0 / np.sqrt(np.exp(mode + logB) + C * sig * (1.0 - sig))
    return rule(NAME, logf, mode[:, None], step)


def _setup(incoming, shape, power):
    s = check_positive_param(NAME, "shape", shape)
    alpha = check_power(power)
    flat, bshape = check_incoming(NAME, FAMILIES, incoming)
    ar, br = flat["r"].shape_param, flat["r"].rate
    ax, bx = flat["x"].shape_param, flat["x"].rate
    c = alpha * (s - 1.0) + ax
    # a message of a larger shape pins its variable to ~1/√shape: the rule's nodes, a few ulp of its
    # log apart at best, cannot resolve that (found in review: the evidence 1e-2 off at shape 1e30)
    narrow = (ar > _MAX_SHAPE) | (ax > _MAX_SHAPE)
    if narrow.any():
        raise_bad_rows(NAME, np.flatnonzero(narrow), f"a message's shape exceeds {_MAX_SHAPE:g}: its variable is "
                       f"known to ~1e-8, beyond what the rule resolves")
    bad = ~(c > 0)
    if bad.any():
        raise_bad_rows(
            NAME, np.flatnonzero(bad),
            "the tilted distribution is improper: power*(shape - 1) + incoming x shape <= 0, "
            "so x^(c-1) is not integrable at 0",
        )
    return s, alpha, flat, bshape, (ar, br, ax, bx, c)


def belief(to: str, incoming: Mapping[str, Family], projection: str = "kl", power: float = 1.0,
           shape: float = 1.0) -> Gamma:
    """Projected Gamma belief on ``to`` in {"r", "x"} (KL projection or ``"moments"``), for the
    factor to the power ``power`` (power EP; 1 for EP)."""
    check_to(NAME, tuple(FAMILIES), to)
    check_projection(projection)
    s, alpha, flat, bshape, (ar, br, ax, bx, c) = _setup(incoming, shape, power)
    if is_empty(bshape):
        return empty_belief(Gamma, bshape)
    if to == "r":  # (the message's shape, the factor's power of the variable, …)
        A0, e, B, C, K = ar, alpha * s, br, c, bx
    else:
        A0, e, B, C, K = ax, alpha * (s - 1.0), bx, alpha * s + ar + np.zeros_like(c), br
    u, lw, lz0 = _rule(A0, e, B, C, K, alpha)
    # (log E[v^k]: the integral with v^k less the one without — the shift and C log K common to both)
    return gamma_belief(NAME, u, lw, lambda k: _rule(A0, e, B, C, K, alpha, k)[2] - lz0,
                        projection).reshape(bshape)


def log_partition(incoming: Mapping[str, Family], power: float = 1.0, shape: float = 1.0) -> np.ndarray:
    """log ∫∫ Gamma(x; shape, r)^power Gamma(r; a_r, b_r) Gamma(x; a_x, b_x) dr dx."""
    s, alpha, flat, bshape, (ar, br, ax, bx, c) = _setup(incoming, shape, power)
    if is_empty(bshape):
        return np.zeros(bshape)
    lz = _rule(ar, alpha * s, br, c, bx, alpha)[2]
    # = raw + c(ar) − C ln bx + ar ln br + ax ln bx + lnΓ(C) − lnΓ(ar) − lnΓ(ax) − α lnΓ(s), C = ax + d,
    # d = α(s − 1), in sums that do not cancel when a message is concentrated (ar or ax ~ 1e14)
    d = alpha * (s - 1.0)
    lz = (lz + gamma_normaliser(ar) - d * np.log(bx) + log_gamma_ratio(ax, d + np.zeros_like(ax))
          - alpha * special.gammaln(s))
    return lz.reshape(bshape)


def sample(inputs: Mapping[str, np.ndarray], size: int, rng: np.random.Generator,
           shape: float = 1.0) -> np.ndarray:
    """x ~ Gamma(shape, rate=r) for each of the ``size`` rates ``inputs["r"]`` (> 0)."""
    s = check_positive_param(NAME, "shape", shape)
    ins, size = check_sample_inputs(NAME, INPUTS, inputs, size)
    r = ins["r"]
    if np.any(~(r > 0)):
        raise ValueError(f"{NAME}: `inputs['r']` must be > 0 (a rate)")
    return rng.gamma(s, 1.0 / r, size=size)
