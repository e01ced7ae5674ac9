"""Exact EP rules of the ``exp`` factor: x (Gaussian) → y = e^x (Gamma).

With incoming N(x; m, v) and Gamma(y; a, b), the delta integrates y out and the tilted
distribution is one-dimensional in x:

    w(x) = N(x; m, v) · Gamma(e^x; a, b) ∝ exp(−(x − m)²/(2v) + (a − 1) x − b e^x),

strictly log-concave (w'' = −1/v − b e^x), so its single mode solves x + v b e^x = c with
c = m + v(a − 1): x* = c − W(v b e^c), bracketed in [c − log(1 + v b e^c), c] (W(z) ≤ log(1+z)).

* belief on x: the first two moments of w (level panels about the mode, Gauss–Legendre);
* belief on y: E[y] = E_w[e^x], E[log y] = E_w[x] (KL projection), or E[y], Var[y] (moments).
  E_w[e^{kx}] is the same integral with a → a + k, so the tail-dominated moments of a broad w
  (x-variance up to 100 and beyond) get panels placed for their own integrand;
* ``log_partition``: log ∫ N(x; m, v) Gamma(e^x; a, b) dx.

Power EP: not supported.  The factor is the deterministic constraint δ(y − e^x); its power
δ^α (α ≠ 1) is not a density, so there is no powered tilted distribution; ``power`` other than
1 raises NotImplementedError.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

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
    gaussian_from_nodes,
    is_empty,
    log_concave_mode,
    raise_bad_rows,
    rule,
)

NAME = "exp"
INPUTS = ("x",)
OUTPUT = "y"
FAMILIES = {"x": Gaussian, "y": Gamma}
PARAMS: dict = {}
SUPPORTS_POWER = False

__all__ = ["belief", "log_partition", "sample"]


def _no_power(power):
    if check_power(power) != 1.0:
        raise NotImplementedError(
            "exp: power EP is not available: the factor is the deterministic constraint "
            "y = e^x, whose power δ(y − e^x)^α (α ≠ 1) is not a density"
        )


def _rule(m, v, a, b, k: int = 0, centre=None):
    """Panel rule for exp(−(x−m)²/(2v) + a x − b e^x − c + (k−1) x), c the Gamma exponent's value at
    its mode (:func:`~kjit.exact._common.gamma_shift`, given back by the normaliser
    :func:`~kjit.exact._common.gamma_normaliser`; the power k − 1 kept apart from a, which cannot
    carry it beyond shape 1e16); returns (t, lw, raw log integral without −(m − centre)²/(2v), that
    constant, the centre).  ``centre``: where x's log density is expanded (default: the mode) — rules
    whose log integrals are differenced share one, so the constant cancels exactly."""
    am1 = a - 1.0 + k  # (for the mode only)
    logb = np.log(b)
    u0 = gamma_shift(a, b)
    extra = np.full_like(a, k - 1.0)

    given = centre  # (else the mode, set below: x's log density is expanded about it)

    def logf(t, rows=None):
        # −(t − m)²/(2v) about the mode c: −(m − c)²/(2v) + (t − c)(m − c)/v − (t − c)²/(2v), the same
        # number, but where |m| ≫ |t| (a message N(1e20, 1e20): slope m/v = 1 near the mode) the
        # direct form loses t in t − m and with it the slope (found by a hostile-input audit: the
        # belief came out as if x's message were flat, KL 1.4)
        # (the constant, which would swamp the rest there, is added to the log integral instead)
        mm, vv, aa, ee, uu, cc = (col(p, t, rows) for p in (m, v, a, extra, u0, centre))
        d = t - cc
        with np.errstate(over="ignore"):
            return (d * ((mm - cc) / vv) - 0.5 * d * d / vv) + gamma_exponent(t, aa, uu, ee)

    def dlogf(t, rows=None):
        mm, vv, cc, lb = (col(p, t, rows) for p in (m, v, am1, logb))
        with np.errstate(over="ignore"):
            return -(t - mm) / vv + cc - np.exp(t + lb)

    c = m + v * am1
    # the mode lies in [c − softplus(s), c], s = log v + log b + c; for a large s, c − softplus(s) is
    # −(log v + log b) − softplus(−s), which does not cancel c away
    s_ = np.log(v) + logb + c
    with np.errstate(over="ignore"):
        lo = np.where(s_ > 0.0, -(np.log(v) + logb) - np.logaddexp(0.0, -s_), c - np.logaddexp(0.0, s_))
    mode = log_concave_mode(dlogf, np.minimum(lo, c), c)
    step = 1.0 / np.sqrt(1.0 / v + np.exp(mode + logb))
    # nodes a step apart about the mode must be distinct doubles: a message N(−1e100, 1e100) puts them
    # at −1e100 ± 1e50, where the doubles are 1e84 apart (the audit: variance 3.8e168 came back)
    coarse = ~(step > _MIN_RELATIVE_STEP * np.abs(mode))
    if coarse.any():
        raise_bad_rows(NAME, np.flatnonzero(coarse), "the tilted density's width is below the resolution of doubles "
                       f"at its mode ({_MIN_RELATIVE_STEP:g} of it): its nodes cannot be placed")
    centre = mode if given is None else given
    t, lw, log_z = rule(NAME, logf, mode[:, None], step)
    with np.errstate(over="ignore"):
        return t, lw, log_z, -0.5 * (m - centre) * ((m - centre) / v), centre  # (no overflow in the square)


#: the smallest node spacing, relative to the mode, the rule places (doubles are 2.2e-16 apart relatively)
_MIN_RELATIVE_STEP = 1e-14  # (1e-12 refused N(-30, 1e-23), which the rule answers to ~1e-6: found in review)


#: a y message of a larger shape pins y (and x = log y) to ~1/√shape, beyond what the rule's nodes
#: resolve: refused by row (found in review: the evidence 0.03 off and x's variance 30 % off at 1e30)
_MAX_SHAPE = 1e16


def _params(flat):
    x, y = flat["x"], flat["y"]
    narrow = y.shape_param > _MAX_SHAPE
    if narrow.any():
        raise_bad_rows(NAME, np.flatnonzero(narrow), f"the y message's shape exceeds {_MAX_SHAPE:g}: y is known to "
                       f"~1e-8, beyond what the rule resolves")
    return x.mean(), x.var(), y.shape_param, y.rate


def belief(to: str, incoming: Mapping[str, Family], projection: str = "kl", power: float = 1.0) -> Family:
    """Projected belief proj[r_{f→to}] for ``to`` in {"x", "y"}.

    Gaussian belief on x by its first two moments (``projection`` is irrelevant for it); Gamma
    belief on y by the KL projection (E[y], E[log y]) or, with ``projection="moments"``, by its
    mean and variance.  ``power`` must be 1 (see the module docstring).
    """
    check_to(NAME, tuple(FAMILIES), to)
    check_projection(projection)
    _no_power(power)
    flat, shape = check_incoming(NAME, FAMILIES, incoming)
    if is_empty(shape):
        return empty_belief(FAMILIES[to], shape)
    m, v, a, b = _params(flat)
    t, lw, lz0, _, c0 = _rule(m, v, a, b)
    if to == "x":
        mean, var = gaussian_from_nodes(t, lw)
        return gaussian_belief(NAME, mean, var).reshape(shape)
    return gamma_belief(NAME, t, lw, lambda k: _rule(m, v, a, b, k, centre=c0)[2] - lz0, projection).reshape(shape)


def log_partition(incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
    """log ∫ N(x; m, v) Gamma(e^x; a, b) dx (normalised incoming messages)."""
    _no_power(power)
    flat, shape = check_incoming(NAME, FAMILIES, incoming)
    if is_empty(shape):
        return np.zeros(shape)
    m, v, a, b = _params(flat)
    _, _, raw, const, _ = _rule(m, v, a, b)
    lz = raw + const - 0.5 * np.log(2.0 * np.pi * v) + gamma_normaliser(a)
    return lz.reshape(shape)


def sample(inputs: Mapping[str, np.ndarray], size: int, rng: np.random.Generator) -> np.ndarray:
    """y = e^x for each of the ``size`` input draws (deterministic; ``rng`` unused)."""
    ins, size = check_sample_inputs(NAME, INPUTS, inputs, size)
    with np.errstate(over="ignore"):
        return np.exp(ins["x"])
