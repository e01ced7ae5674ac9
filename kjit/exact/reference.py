"""Independent reference computations for the exact rules (validation and benchmarks only).

Each belief is recomputed through a *different reduction* of the same tilted integral and a
*different engine*: scipy's adaptive Gauss–Kronrod ``quad_vec`` (epsrel 1e-12, or 1e-15·|log w|
where the integrand's own rounding is coarser; all moments of a pass in one vector integral;
the peak located by a brute-force scan; variances in a centred second pass; Gamma statistics in
units of a centre so that log E[v] − E[log v] is formed without cancellation).  Slow (≈0.05–0.5 s a
message) and scalar: for tests and ``benchmarks/factors.py``, never for serving.

* product: the rules integrate over x (beliefs on x, z) / y (belief on y); the reference
  integrates over the *other* input: given y, x ↦ z is linear, so x's and z's beliefs are
  mixtures of their Gaussian posteriors given y;
* gaussian: the rule integrates over τ; the reference over d = x − m (τ out in closed form: a
  Student-t in d; τ | d ~ Gamma(a + α/2, b + α d²/2); m | d Gaussian);
* gamma_rate: the belief on r through the integral over x (r | x ~ Gamma(αs + a_r, b_r + αx)),
  the belief on x through the integral over r (x | r ~ Gamma(c, αr + b_x));
* exp: one variable; the same integral in x, centred at its mode, by quad_vec.

:func:`reference` returns ``(log Z, {variable: Family})``; :func:`rel_error` is the agreement
measure used by the tests and the benchmark: the largest relative error of the belief's
parameters, a Gaussian mean measured relative to max(|mean|, sd).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from scipy import integrate, special

from ..families import Family, Gamma, Gaussian

__all__ = ["reference", "rel_error"]


# ---------------------------------------------------------------- engine
def qvec(logw, funcs, lo, hi, points):
    """log ∫ e^{logw} and E[g] for g in funcs, by quad_vec (one adaptive vector integral)."""
    # a brute-force scan finds the peak even where no given point is near it; points around it
    grid = np.linspace(lo, hi, 100_001)
    with np.errstate(all="ignore"):
        vals = np.where(np.isfinite(logw(grid)), logw(grid), -np.inf)
    tm, h = grid[np.argmax(vals)], (hi - lo) / 100_000
    points = list(points) + [tm + s * h * k for k in (0.25, 0.5, 1, 2, 4, 16, 64, 256, 1024) for s in (-1, 1)]
    pts = sorted({float(p) for p in points if lo < p < hi})
    L = max([logw(p) for p in pts + [0.5 * (lo + hi)] if np.isfinite(logw(p))] + [float(np.max(vals))])

    def f(t):
        with np.errstate(all="ignore"):
            w = np.exp(logw(t) - L)
            vals = [1.0] + [g(t) for g in funcs]
        return np.array([w * v if w > 0 else 0.0 for v in vals])

    # the integrand's values carry rounding noise ~1e-16 |logw| (relative): asking for more than
    # that only subdivides to the limit
    epsrel = max(1e-12, 1e-15 * abs(L))
    r, _ = integrate.quad_vec(f, lo, hi, points=pts or None, epsabs=0, epsrel=epsrel, norm="max", limit=2000)
    return np.log(r[0]) + L, r[1:] / r[0]


def ref_gaussian_mixture(logw, mu, s2, lo, hi, points):
    """Moments of the logw-mixture of N(mu(t), s2(t)) (centred second pass)."""
    lz, (m0,) = qvec(logw, [mu], lo, hi, points)
    _, (e2, e1) = qvec(logw, [lambda t: (mu(t) - m0) ** 2 + s2(t), lambda t: mu(t) - m0], lo, hi, points)
    return lz, m0 + e1, e2 - e1 * e1


def ref_gamma(logw, cond, lo, hi, points, v0, projection="kl"):
    """Gamma belief on v from conditionals given t, in units of a centre v0 (no cancellation):
    cond(t) = (E[v/v0 | t], E[log(v/v0) | t], Var[v | t]/v0²), mixed over logw.
    KL: match (E[v], E[log v]); moments: Var[v] = E[Var(v|t)] + Var(E[v|t]), summed centred."""
    lz, (m1, el) = qvec(logw, [lambda t: cond(t)[0], lambda t: cond(t)[1]], lo, hi, points)
    if projection == "kl":
        a = float(Gamma.project(np.array([m1, el])).shape_param)
        return lz, Gamma(a, a / (v0 * m1))
    _, (var,) = qvec(logw, [lambda t: (cond(t)[0] - m1) ** 2 + cond(t)[2]], lo, hi, points)
    return lz, Gamma(m1 * m1 / var, m1 / (v0 * var))


def around(c, scale, ks=(0, 0.3, 1, 2, 4, 8, 16, 32)):
    return [c + s * k * scale for k in ks for s in (-1, 1)]



# ---------------------------------------------------------------- per factor
def product_reference(mx, vx, my, vy, mz, vz):
    """Beliefs on x, z by the integral over y (and y by the integral over x)."""

    def over(m_other, v_other, m_int, v_int):  # integral over the input with message (m_int, v_int)
        def logw(t):
            V = t * t * v_other + vz
            return -0.5 * (t - m_int) ** 2 / v_int - 0.5 * np.log(V) - 0.5 * (t * m_other - mz) ** 2 / V

        sd, sc = np.sqrt(v_int), np.sqrt(vz / v_other)
        pts = around(m_int, sd) + [s * sc * 4.0**k for k in range(-2, 45) for s in (-1, 1)]
        lo, hi = m_int - 45 * sd, m_int + 45 * sd
        if m_other != 0.0:  # where t m_other ≈ m_z: the factor's own peak (can be far narrower than sd)
            t0 = mz / m_other
            s0 = np.sqrt(vz + t0 * t0 * v_other) / abs(m_other)
            pts += around(t0, s0)
            lo, hi = min(lo, t0 - 45 * s0), max(hi, t0 + 45 * s0)
        # the mode can lie outside both peaks (the other input moves too, along z = x y): a
        # log-spaced scan out to 1e7 sds finds it; the range covers it and the tails beyond
        dist = sd * 10.0 ** np.linspace(-4, 7, 40_001)
        scan = np.concatenate([m_int - dist, m_int + dist])
        with np.errstate(all="ignore"):
            vals = logw(scan)
        vals = np.where(np.isfinite(vals), vals, -np.inf)
        n = dist.size  # the best on each side of m_int (w can be bimodal, e.g. x y = z ≠ 0, both at 0)
        t_lo, t_hi = scan[np.argmax(vals[:n])], scan[n + np.argmax(vals[n:])]
        for t_star, gap in ((t_lo, abs(t_lo - m_int)), (t_hi, abs(t_hi - m_int))):
            pts += around(t_star, gap * 1e-3)
        lo, hi = min(lo, t_lo) - 20 * sd, max(hi, t_hi) + 20 * sd
        return logw, [p for p in pts if lo < p < hi], lo, hi

    logw, pts, lo, hi = over(mx, vx, my, vy)  # integral over y
    lz, ex, vxb = ref_gaussian_mixture(
        logw, lambda t: (mx * vz + mz * t * vx) / (t * t * vx + vz), lambda t: vx * vz / (t * t * vx + vz), lo, hi, pts
    )
    _, ez, vzb = ref_gaussian_mixture(
        logw, lambda t: (t * mx * vz + mz * t * t * vx) / (t * t * vx + vz),
        lambda t: t * t * vx * vz / (t * t * vx + vz), lo, hi, pts,
    )
    logw2, pts2, lo2, hi2 = over(my, vy, mx, vx)  # integral over x: y's posterior given x
    _, ey, vyb = ref_gaussian_mixture(
        logw2, lambda t: (my * vz + mz * t * vy) / (t * t * vy + vz), lambda t: vy * vz / (t * t * vy + vz), lo2, hi2, pts2
    )
    lz = lz - 0.5 * np.log(vy) - np.log(2 * np.pi)
    return lz, {"x": (ex, vxb), "y": (ey, vyb), "z": (ez, vzb)}


def gaussian_reference(mm, vm, a, b, mx, vx, alpha, projection="kl"):
    """Integral over d = x − m: τ | d ~ Gamma(a + α/2, b + α d²/2), m | d Gaussian."""
    S, delta = vm + vx, mx - mm
    A = a + 0.5 * alpha

    def logw(d):  # −A log(b + αd²/2) − (d − Δ)²/(2S), the constant −A log b dropped
        return -A * np.log1p(0.5 * alpha * d * d / b) - 0.5 * (d - delta) ** 2 / S

    sd, sc = np.sqrt(S), np.sqrt(b / A / alpha)
    pts = around(delta, sd) + around(0.0, sc, ks=(0, 0.3, 1, 3, 10, 30, 100, 1e3, 1e4))
    # the hull of the two peaks (Δ and 0), widened: a compromise mode lies between
    lo = min(delta - 45 * sd, -45 * sc) - 10 * sd
    hi = max(delta + 45 * sd, 45 * sc) + 10 * sd
    dig = special.digamma(A) - np.log(A)

    def cond(d):  # τ0 = A / b;  τ/τ0 | d has mean 1/(1+ρ), ρ = αd²/(2b)
        k = 1.0 / (1.0 + 0.5 * alpha * d * d / b)
        return k, dig + np.log(k), k * k / A

    lz, qt = ref_gamma(logw, cond, lo, hi, pts, A / b, projection)
    mpost = lambda d: (mm * vx + (mx - d) * vm) / S  # noqa: E731
    _, em, vmb = ref_gaussian_mixture(logw, mpost, lambda d: vm * vx / S, lo, hi, pts)
    _, ex, vxb = ref_gaussian_mixture(logw, lambda d: mpost(d) + d, lambda d: vm * vx / S, lo, hi, pts)
    # constants: Gamma normaliser, Γ(a+α/2)/Γ(a) b^{−A}, (2π)^{-α/2} of f^α, N(d; Δ, S) normaliser
    lz = (
        lz + a * np.log(b) - A * np.log(b) + special.gammaln(A) - special.gammaln(a)
        - 0.5 * alpha * np.log(2 * np.pi) - 0.5 * np.log(2 * np.pi * S)
    )
    return lz, {"tau": qt, "m": (em, vmb), "x": (ex, vxb)}


def _range(A, mode, sd):
    """Integration range and points in u = log v about the mode: the left tail falls like e^{A u}
    (far for small A); for large A the density is ≈ Gaussian in u."""
    left = 80.0 / A + 60.0 if A <= 10 else 60.0 * sd
    lo, hi = mode - left, mode + min(60.0, 60.0 * sd + 5.0)
    pts = around(mode, sd) + [mode - k for k in (1, 3, 10, 30, 100, 300, 1e3, 3e3)]
    return lo, hi, pts


def _mode_u(dfun, lo=-300.0, hi=300.0):
    from scipy.optimize import brentq

    return brentq(dfun, lo, hi, xtol=1e-14)


def _conj_reduction(A, B, C, K, alpha, Apost, projection):
    """∫ e^{A u − B e^u − C log(K + α e^u)} du in centred form about its mode u0, and the Gamma
    belief of the *other* variable v | u ~ Gamma(Apost, K + α e^u) mixed over it."""
    u0 = _mode_u(lambda u: A - B * np.exp(u) - C * special.expit(u + np.log(alpha / K)))
    e0 = np.exp(u0)
    K0 = K + alpha * e0

    def rho(d):  # (K + α e^{u0+d}) / K0 − 1
        return alpha * e0 * np.expm1(d) / K0

    def logw(d):
        return A * d - B * e0 * np.expm1(d) - C * np.log1p(rho(d))

    dig = special.digamma(Apost) - np.log(Apost)

    def cond(d):  # v0 = Apost / K0
        k = 1.0 / (1.0 + rho(d))
        return k, dig + np.log(k), k * k / Apost

    sd = 1.0 / np.sqrt(A + B * e0)
    lo, hi, pts = _range(A, 0.0, sd)
    lz, q = ref_gamma(logw, cond, lo, hi, pts, Apost / K0, projection)
    return lz + A * u0 - B * e0 - C * np.log(K0), q


def gamma_rate_reference(ar, br, ax, bx, s, alpha, projection="kl"):
    c = alpha * (s - 1.0) + ax
    Ar = alpha * s + ar
    # belief on r through the integral over x (u = log x, Jacobian included):
    # w(x) ∝ x^{c−1} e^{−b_x x} (b_r + αx)^{−Ar},  r | x ~ Gamma(Ar, b_r + αx)
    lz, qr = _conj_reduction(c, bx, Ar, br, alpha, Ar, projection)
    lz = (
        lz + ar * np.log(br) + ax * np.log(bx) + special.gammaln(Ar)
        - special.gammaln(ar) - special.gammaln(ax) - alpha * special.gammaln(s)
    )
    # belief on x through the integral over r: w(r) ∝ r^{Ar−1} e^{−b_r r} (αr + b_x)^{−c}, x | r ~ Gamma(c, αr + b_x)
    _, qx = _conj_reduction(Ar, br, c, bx, alpha, c, projection)
    return lz, {"r": qr, "x": qx}


def exp_reference(m, v, a, b, projection="kl"):
    from scipy.optimize import brentq

    c = m + v * (a - 1.0)
    with np.errstate(over="ignore"):
        x0 = brentq(lambda x: (c - x) / v - b * np.exp(x), c - np.logaddexp(0, np.log(v * b) + c) - 1, c + 1, xtol=1e-15)
    y0 = np.exp(x0)

    def logw(d):  # log w(x0 + d) − log w(x0)
        with np.errstate(over="ignore"):
            return -(d * d + 2.0 * d * (x0 - m)) / (2.0 * v) + (a - 1.0) * d - b * y0 * np.expm1(d)

    sd = 1.0 / np.sqrt(1.0 / v + b * y0)
    lo, hi = -45.0 * np.sqrt(v) - 45.0 * sd, 45.0 * sd + 2.0 * np.sqrt(v)
    pts = around(0.0, sd) + around(0.0, np.sqrt(v))
    lz, ex, vx = ref_gaussian_mixture(logw, lambda d: d, lambda d: 0.0, lo, hi, pts)
    lz, qy = ref_gamma(logw, lambda d: (np.exp(d), d, 0.0), lo, hi, pts, y0, projection)
    lz = lz - 0.5 * (x0 - m) ** 2 / v + (a - 1.0) * x0 - b * y0
    lz = lz - 0.5 * np.log(2 * np.pi * v) + a * np.log(b) - special.gammaln(a)
    return lz, {"x": (x0 + ex, vx), "y": qy}


def reference(name: str, incoming: Mapping[str, Family], projection: str = "kl", power: float = 1.0,
              **params) -> tuple[float, dict]:
    """(log Z, {variable: belief}) for one message (scalar incoming messages) of factor ``name``."""
    f = {v: tuple(float(np.asarray(a).reshape(())) for a in m.params) for v, m in incoming.items()}
    if name == "product":
        if power != 1.0:
            raise NotImplementedError("product: no power")
        lz, out = product_reference(*f["x"], *f["y"], *f["z"])
    elif name == "gaussian":
        lz, out = gaussian_reference(*f["m"], *f["tau"], *f["x"], float(power), projection)
    elif name == "gamma_rate":
        lz, out = gamma_rate_reference(*f["r"], *f["x"], float(params.get("shape", 1.0)), float(power), projection)
    elif name == "exp":
        if power != 1.0:
            raise NotImplementedError("exp: no power")
        lz, out = exp_reference(*f["x"], *f["y"], projection)
    else:
        raise ValueError(f"no reference for factor {name!r}")
    return float(lz), {v: (Gaussian(*q) if isinstance(q, tuple) else q) for v, q in out.items()}


def rel_error(q: Family, ref: Family) -> float:
    """Largest relative error of q's parameters against ref's (Gaussian mean: relative to max(|mean|, sd))."""
    if isinstance(ref, Gaussian):
        m, v = float(ref.mean()), float(ref.var())
        return max(abs(float(q.mean()) - m) / max(abs(m), np.sqrt(v)), abs(float(q.var()) / v - 1.0))
    return max(abs(float(a) / float(b) - 1.0) for a, b in zip(q.params, ref.params))
