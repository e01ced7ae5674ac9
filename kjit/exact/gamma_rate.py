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
    gamma_shift_change,
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

__all__ = ["belief", "log_partition", "sample"]


def _rule(A, B, C, K, alpha, k: int = 0):
    """Panel rule in u for exp((A+k) u − B e^u − C log(α e^u + K)), integrated as
    exp((A+k) u − B e^u − c − C log(1 + α e^u / K)) — c the first part's value at its mode
    (:func:`~kjit.exact._common.gamma_shift`), C log K taken out: each is ~a ln a for a concentrated
    message, and they cancelled against the normalisers (found by an audit: the evidence 0.24 nats
    off at shape 1e14).  Returns (u, lw, raw log integral of that integrand, c); the integral
    asked for is raw + c − C log K."""
    Ak = A + k
    logB, logK, loga = np.log(B), np.log(K), np.log(alpha)
    u0, shift = gamma_shift(Ak, B)

    def logf(t, rows=None):
        aa, lb, cc, lk, uu = (col(p, t, rows) for p in (Ak, logB, C, logK, u0))
        with np.errstate(over="ignore"):
            return gamma_exponent(t, aa, lb, uu) - cc * np.logaddexp(0.0, t + loga - lk)

    def dlogf(t, rows=None):
        aa, lb, cc, lk = (col(p, t, rows) for p in (Ak, logB, C, logK))
        with np.errstate(over="ignore"):
            return aa - np.exp(t + lb) - cc * special.expit(t + loga - lk)

    hi = np.log(Ak) - logB
    lo = np.log(Ak) - np.logaddexp(logB, np.log(C) + loga - logK)
    mode = log_concave_mode(dlogf, lo, hi)
    sig = special.expit(mode + loga - logK)
    step = 1.0 / np.sqrt(np.exp(mode + logB) + C * sig * (1.0 - sig))
    u, lw, lz = rule(NAME, logf, mode[:, None], step)
    return u, lw, lz, shift


def _setup(incoming, shape, power):
    s = check_positive_param(NAME, "shape", shape)
    alpha = check_power(power)
    flat, bshape = check_incoming(NAME, FAMILIES, incoming)
    ar, br = flat["r"].shape_param, flat["r"].rate
    ax, bx = flat["x"].shape_param, flat["x"].rate
    c = alpha * (s - 1.0) + ax
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
    if to == "r":
        A, B, C, K = ar + alpha * s, br, c, bx
    else:
        A, B, C, K = c, bx, alpha * s + ar + np.zeros_like(c), br
    u, lw, lz0, c0 = _rule(A, B, C, K, alpha)

    def log_moment(k):  # (C log K is common to both integrals)
        _, _, lzk, ck = _rule(A, B, C, K, alpha, k)
        return lzk - lz0 + gamma_shift_change(A, k, B, c0, ck)

    return gamma_belief(NAME, u, lw, log_moment, projection).reshape(bshape)


def log_partition(incoming: Mapping[str, Family], power: float = 1.0, shape: float = 1.0) -> np.ndarray:
    """log ∫∫ Gamma(x; shape, r)^power Gamma(r; a_r, b_r) Gamma(x; a_x, b_x) dr dx."""
    s, alpha, flat, bshape, (ar, br, ax, bx, c) = _setup(incoming, shape, power)
    if is_empty(bshape):
        return np.zeros(bshape)
    A = ar + alpha * s
    _, _, lz, shift = _rule(A, br, c, bx, alpha)
    # = lz + shift − c log bx + ar log br + ax log bx + lnΓ(c) − lnΓ(ar) − lnΓ(ax) − α lnΓ(s), in sums
    # that do not cancel when a message is concentrated (ar or ax ~ 1e14)
    lz = (
        lz + gamma_normaliser(ar, A, br, shift) - (c - ax) * np.log(bx) + log_gamma_ratio(ax, c - ax)
        - alpha * special.gammaln(s)
    )
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
