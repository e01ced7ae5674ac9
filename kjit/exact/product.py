"""Exact EP rules of the ``product`` factor: x, y (Gaussian) → z = x·y (Gaussian).

Incoming N(x; m_x, v_x), N(y; m_y, v_y), N(z; m_z, v_z).  Given x, y ↦ z = x y is linear, so y
and z integrate out in closed form and the tilted distribution is a 1-D integral over x:

    w(x) = N(x; m_x, v_x) · N(x m_y; m_z, V(x)),   V(x) = x² v_y + v_z.

* belief on x: the first two moments of w;
* belief on z: the w-mixture of the Gaussian posterior of z given x,
  N((x m_y v_z + m_z x² v_y) / V, x² v_y v_z / V), by its mixture moments (E[var] + Var[mean],
  summed centred) — both functions are bounded in x;
* belief on y: the same with x and y exchanged (integral over y);
* ``log_partition``: log ∫ w.

w is not log-concave (it can have two modes, e.g. z observed far from m_x m_y with a broad x,
and a spike at 0 when m_z ≈ 0 and v_z is small): its derivative times v_x V(x)² is the quintic

    −(x − m_x) V² − v_x v_y x V − v_x (x m_y − m_z)(m_y v_z + m_z v_y x),

whose real roots (companion-matrix eigenvalues, kept as they are and refined by bisection on the derivative's sign
changes) are all of w's stationary points; only those within the region where
N(x; m_x, v_x) (2π v_z)^{−1/2} — an upper bound of w — exceeds e^{−60} of w's largest found
value can matter.  The panel rule is cut at these points, at ±σ, ±3σ, ±6σ, ±12σ about each
(σ a local curvature scale), and at ±√(v_z/v_y) 4^k: where x² v_y ≫ v_z the factor decays like
1/|x| over decades (an x message centred at 0 with z ≈ 0), which level panels alone resolve
poorly; geometric panels of ratio 4 integrate it to ~1e-12.

Power EP: not supported.  The factor is the deterministic constraint δ(z − x y); its power
δ^α (α ≠ 1) is not a density, so there is no powered tilted distribution; ``power`` other
than 1 raises NotImplementedError.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..families import Family, Gaussian
from ._common import (
    check_incoming,
    check_power,
    check_projection,
    check_sample_inputs,
    check_to,
    col,
    empty_belief,
    gaussian_belief,
    gaussian_from_nodes,
    gaussian_mixture,
    is_empty,
    rule,
    stationary_points,
)

NAME = "product"
INPUTS = ("x", "y")
OUTPUT = "z"
FAMILIES = {"x": Gaussian, "y": Gaussian, "z": Gaussian}
PARAMS: dict = {}
SUPPORTS_POWER = False

__all__ = ["belief", "log_partition", "sample"]

_LOG_2PI = np.log(2.0 * np.pi)
_LOCAL = np.array([1.0, 3.0, 6.0, 12.0])
_MAX_GEOMETRIC = 64


def _no_power(power):
    if check_power(power) != 1.0:
        raise NotImplementedError(
            "product: power EP is not available: the factor is the deterministic constraint "
            "z = x·y, whose power δ(z − x y)^α (α ≠ 1) is not a density"
        )


def log_weight(t, m1, v1, m2, v2, mz, vz):
    """log w(t) up to a constant: −(t − m1)²/(2 v1) − ½ log V − (t m2 − mz)²/(2V), V = t² v2 + vz
    (NaN where it overflows; the callers treat those nodes as carrying no mass)."""
    with np.errstate(over="ignore", invalid="ignore"):
        V = t * t * v2 + vz
        return -0.5 * (t - m1) ** 2 / v1 - 0.5 * np.log(V) - 0.5 * (t * m2 - mz) ** 2 / V


def z_given(t, m2, v2, mz, vz, offset: bool = False):
    """Mean and variance of z's Gaussian posterior given the integrated input t:
    ((t m2 vz + mz t² v2) / V, t² v2 vz / V); ``offset``: the mean less mz, (t m2 − mz) vz / V — formed as
    such, it keeps what distinguishes the nodes when mz is large (found by an audit: about mz = 1e100 the
    means' rounding, ~1e84, made a belief variance of 2 come out 7e167)."""
    with np.errstate(over="ignore", invalid="ignore"):
        t2v = t * t * v2
        V = t2v + vz
        if offset:
            return (t * m2 - mz) * (vz / V), t2v * vz / V
        return (t * m2 * vz + mz * t2v) / V, t2v * vz / V


def stationary_candidates(m1, v1, m2, v2, mz, vz):
    """``(candidates (B, 5), real (B, 5))``: the real parts of the quintic's roots — approximately every
    stationary point of w(t) = N(t; m1, v1) N(t m2; mz, t² v2 + vz), NaN on rows whose coefficients are not
    finite — and which roots are real (those are stationary points themselves: the quintic is d log w times
    v1 V² with V > 0)."""
    B = m1.size
    c = vz / v2  # the scale² where the factor's variance switches from v_z to x² v_y
    # the quintic / (−v_y²) in the scaled variable ξ = t / lam
    lam = np.abs(m1) + np.sqrt(v1) + np.sqrt(c)
    k4 = -m1
    k3 = 2.0 * c + v1
    k2 = -2.0 * m1 * c + v1 * m2 * mz / v2
    k1 = c * c + v1 * c + v1 * m2 * m2 * c / v2 - v1 * mz * mz / v2
    k0 = -m1 * c * c - v1 * m2 * mz * c / v2
    ks = np.stack([k4 / lam, k3 / lam**2, k2 / lam**3, k1 / lam**4, k0 / lam**5], axis=1)
    comp = np.zeros((B, 5, 5))
    ok = np.all(np.isfinite(ks), axis=1)
    comp[:, 0, :] = np.where(ok[:, None], -ks, 0.0)
    for i in range(1, 5):
        comp[:, i, i - 1] = 1.0
    roots_c = np.linalg.eigvals(comp)
    cand = np.where(ok[:, None], roots_c.real * lam[:, None], np.nan)
    return cand, np.abs(roots_c.imag) <= 1e-6 * np.abs(roots_c)


def curvature_scale(t, m1, v1, m2, v2, mz, vz):
    """(B, K): a local scale of w about the points ``t`` (B, K): 1/√κ with κ = 1/v1 + (m2² + v2)/V +
    (mz² + vz) v2 / V², V = t² v2 + vz — an upper bound of −(log w)'' of the same order, positive everywhere
    (the panel rule's step; the reference's check centres its nodes with it)."""
    V = t * t * v2[:, None] + vz[:, None]
    kappa = 1.0 / v1[:, None] + (m2 * m2 + v2)[:, None] / V + ((mz * mz + vz) * v2)[:, None] / (V * V)
    return 1.0 / np.sqrt(kappa)


def _rule(m1, v1, m2, v2, mz, vz):
    """Panel rule over t (the integrated input, message N(m1, v1); the other input N(m2, v2)).

    log w(t) = −(t − m1)²/(2 v1) − ½ log V − (t m2 − mz)²/(2V) (constants dropped).
    Returns (t, lw, raw log integral)."""

    def logf(t, rows=None):
        out = log_weight(t, *(col(p, t, rows) for p in (m1, v1, m2, v2, mz, vz)))
        return np.where(np.isnan(out), -np.inf, out)

    def dlogf(t, rows=None):
        a1, b1, a2, b2, az, bz = (col(p, t, rows) for p in (m1, v1, m2, v2, mz, vz))
        with np.errstate(over="ignore", invalid="ignore"):
            V = t * t * b2 + bz
            R = t * a2 - az
            return -(t - a1) / b1 - t * b2 / V - R * a2 / V + R * R * t * b2 / (V * V)

    B = m1.size
    c = vz / v2  # the scale² where the factor's variance switches from v_z to x² v_y
    cand, real = stationary_candidates(m1, v1, m2, v2, mz, vz)
    # the region where w can matter: N(t; m1, v1) (2π v_z)^{-1/2} >= e^{-60} max w
    probe = np.concatenate([m1[:, None], np.where(np.isfinite(cand), cand, m1[:, None])], axis=1)
    fstar = np.max(logf(probe) - 0.5 * np.log(v1)[:, None], axis=1)  # = max log w + log 2π at the probes
    q = np.maximum(-np.log(v1) * 0.5 - 0.5 * np.log(vz) - fstar + 60.0, 60.0)
    half = np.sqrt(2.0 * v1 * q)
    lo, hi = m1 - half, m1 + half
    roots = stationary_points(dlogf, cand, lo, hi, accept=real)
    finite = np.isfinite(roots)
    if not finite.any(axis=1).all():  # cannot happen for a proper w (it has a maximum); keep m1
        roots[~finite.any(axis=1), 0] = m1[~finite.any(axis=1)]
        finite = np.isfinite(roots)
    r = np.where(finite, roots, m1[:, None])
    sig = curvature_scale(r, m1, v1, m2, v2, mz, vz)
    local = (r[:, :, None] + sig[:, :, None] * np.concatenate([-_LOCAL, _LOCAL])).reshape(B, -1)
    local = np.where(np.repeat(finite, 2 * _LOCAL.size, axis=1), local, np.nan)
    # geometric breaks ±√c 4^k inside [lo, hi]
    sc = np.sqrt(c)
    with np.errstate(divide="ignore"):
        ratio = np.max(np.maximum(np.abs(lo), np.abs(hi)) / sc)
    K = int(np.clip(np.ceil(np.log(max(ratio, 1.0)) / np.log(4.0)), 0, _MAX_GEOMETRIC))
    geo = sc[:, None] * 4.0 ** np.arange(K + 1)
    geo = np.concatenate([-geo, geo], axis=1)
    geo = np.where((geo > lo[:, None]) & (geo < hi[:, None]), geo, np.nan)
    breaks = np.concatenate([roots, local, geo], axis=1)
    breaks = np.where((breaks >= lo[:, None]) & (breaks <= hi[:, None]), breaks, np.nan)
    best = np.argmax(np.where(finite, logf(r), -np.inf), axis=1)
    step = sig[np.arange(B), best]
    return rule(NAME, logf, breaks, step)


def _setup(incoming, power):
    _no_power(power)
    flat, shape = check_incoming(NAME, FAMILIES, incoming)
    return flat, shape


def _args(flat, over: str):
    """Messages of (integrated input, other input) for the integral over ``over``."""
    other = "y" if over == "x" else "x"
    a, b, z = flat[over], flat[other], flat["z"]
    return a.mean(), a.var(), b.mean(), b.var(), z.mean(), z.var()


def belief(to: str, incoming: Mapping[str, Family], projection: str = "kl", power: float = 1.0) -> Gaussian:
    """Gaussian belief on ``to`` in {"x", "y", "z"} by its first two moments (``projection`` is
    irrelevant for Gaussian beliefs: "kl" and "moments" coincide).  ``power`` must be 1."""
    check_to(NAME, tuple(FAMILIES), to)
    check_projection(projection)
    flat, shape = _setup(incoming, power)
    if is_empty(shape):
        return empty_belief(Gaussian, shape)
    over = "y" if to == "y" else "x"
    m1, v1, m2, v2, mz, vz = _args(flat, over)
    t, lw, _ = _rule(m1, v1, m2, v2, mz, vz)
    if to in ("x", "y"):
        mean, var = gaussian_from_nodes(t, lw)
    else:
        d, var_ = z_given(t, m2[:, None], v2[:, None], mz[:, None], vz[:, None], offset=True)
        # nodes whose weight underflowed may hold inf/nan terms: they carry no mass
        keep = np.isfinite(d) & np.isfinite(var_) & np.isfinite(lw)
        lw = np.where(keep, lw, -np.inf)
        mean, var = gaussian_mixture(lw, np.where(keep, d, 0.0), np.where(keep, var_, 0.0))
        mean = mz + mean
    return gaussian_belief(NAME, mean, var).reshape(shape)


def log_partition(incoming: Mapping[str, Family], power: float = 1.0) -> np.ndarray:
    """log ∫ N(x; m_x, v_x) N(y; m_y, v_y) N(x y; m_z, v_z) dx dy."""
    flat, shape = _setup(incoming, power)
    if is_empty(shape):
        return np.zeros(shape)
    m1, v1, m2, v2, mz, vz = _args(flat, "x")
    lz = _rule(m1, v1, m2, v2, mz, vz)[2] - 0.5 * np.log(v1) - _LOG_2PI
    return lz.reshape(shape)


def sample(inputs: Mapping[str, np.ndarray], size: int, rng: np.random.Generator) -> np.ndarray:
    """z = x·y for each of the ``size`` input pairs (deterministic; ``rng`` unused)."""
    ins, size = check_sample_inputs(NAME, INPUTS, inputs, size)
    return ins["x"] * ins["y"]
