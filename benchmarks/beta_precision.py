#!/usr/bin/env python
"""Beta.kl and Beta.project against mpmath: the worst relative errors per regime.

Reference.  KL[Beta(a1, b1) ‖ Beta(a2, b2)] = ln B(a2, b2) − ln B(a1, b1) + (a1 − a2)(ψ(a1) − ψ(s1)) +
(b1 − b2)(ψ(b1) − ψ(s1)) (s1 = a1 + b1) in mpmath at ``--dps`` digits (150: the terms reach ~1e28 and cancel to
KLs of ~1, leaving > 100 digits), the parameters taken as the exact doubles given.  Beside each error its
condition number κ = Σ |θ ∂KL/∂θ| / KL over the four parameters θ (∂KL/∂a2 = ψ(a2) − ψ(s2) − ψ(a1) + ψ(s1),
∂KL/∂a1 = (a1 − a2) ψ'(a1) − (s1 − s2) ψ'(s1), and likewise for b): a double's rounding of the parameters
(1.1e-16 relative) alone moves the KL by up to κ · 1.1e-16, the floor of any double computation from them.

Projection.  Statistics (E ln x, E ln(1 − x)) are formed in mpmath from a Beta(α, β) and rounded to doubles; the
exact answer to those doubles is found by mpmath's Newton (findroot) from (α, β); the error reported is the
largest relative error of the answer's α, β.  Its condition: ‖diag(θ)⁻¹ J⁻¹ diag(s)‖∞ · 1.1e-16, the
statistics' own rounding carried to the parameters (J the Jacobian ∂s/∂θ).

Regimes (seeded, ``--n`` pairs each, ``--n-project`` for the projection's): ``far`` — each of the four
parameters log-uniform on 1e-12…1e16;
``drop`` — p's parameters 1e12…1e16, q's 1e-12…1e2 (a parameter falls by ~16 orders: the terms ~1e16 cancel
to a KL ~20); ``rise`` — the reverse; ``scale`` — q = p scaled by 10^U(−16, 16) (mean-matched, far); ``half`` —
one parameter kept, the other log-uniform on 1e-12…1e16;
``near``, ``mean_matched``, ``near_wide``, ``lopsided`` — as tests/test_families_precision.py draws them.
Projection regimes: ``proj_wide`` — α, β log-uniform 1e-12…1e16; ``proj_tiny`` — one parameter 1e-12…1e-9
(one statistic ~ −1/α, up to ~1e12 in magnitude), the other 1e-3…1e6.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/beta_precision.py [--n 400] [--n-project 2000] [--dps 150]

``--quick``: 40 pairs a KL regime, 200 draws a projection regime (the rare projection failures may be missed).

One JSON line per regime: ``worst_rel`` (largest relative error), ``worst_case`` (its parameters),
``worst_over_floor`` (largest error / (κ · 1.1e-16)), ``nonfinite`` (count).
"""

from __future__ import annotations

import argparse
import json

import mpmath as mp
import numpy as np

from kjit.families import Beta

EPS = 2.0**-53


def kl_ref(a1, b1, a2, b2):
    """(KL, κ) in mpmath at the working precision."""
    a1, b1, a2, b2 = (mp.mpf(float(x)) for x in (a1, b1, a2, b2))
    s1, s2 = a1 + b1, a2 + b2
    pa1, pb1, ps1 = mp.digamma(a1), mp.digamma(b1), mp.digamma(s1)
    pa2, pb2, ps2 = mp.digamma(a2), mp.digamma(b2), mp.digamma(s2)
    lb = lambda a, b: mp.loggamma(a) + mp.loggamma(b) - mp.loggamma(a + b)  # noqa: E731
    kl = lb(a2, b2) - lb(a1, b1) + (a1 - a2) * (pa1 - ps1) + (b1 - b2) * (pb1 - ps1)
    ta1, tb1, ts1 = mp.psi(1, a1), mp.psi(1, b1), mp.psi(1, s1)
    grad = (a1 * ((a1 - a2) * ta1 - (s1 - s2) * ts1), b1 * ((b1 - b2) * tb1 - (s1 - s2) * ts1),
            a2 * (pa2 - ps2 - pa1 + ps1), b2 * (pb2 - ps2 - pb1 + ps1))
    return kl, sum(abs(g) for g in grad) / abs(kl)


def draw_pairs(kind, n, rng):
    lu = lambda lo, hi, shape: 10 ** rng.uniform(lo, hi, shape)  # noqa: E731
    if kind == "far":
        return lu(-12, 16, (n, 2)), lu(-12, 16, (n, 2))
    if kind == "drop":
        return lu(12, 16, (n, 2)), lu(-12, 2, (n, 2))
    if kind == "rise":
        return lu(-12, 2, (n, 2)), lu(12, 16, (n, 2))
    if kind == "scale":
        p = lu(-12, 16, (n, 2))
        return p, p * lu(-16, 16, (n, 1))
    if kind == "half":
        p = lu(-12, 16, (n, 2))
        q, j = p.copy(), rng.integers(0, 2, n)
        q[np.arange(n), j] = lu(-12, 16, n)
        return p, q
    if kind == "near":
        p = lu(-1, 2, (n, 2))
        return p, p * (1 + lu(-9, -5, p.shape) * rng.choice([-1, 1], p.shape))
    if kind == "mean_matched":
        p = lu(-3, 14, (n, 2))
        return p, p * (1 + lu(-8, -2, (n, 1)))
    if kind == "near_wide":
        p = lu(-3, 14, (n, 2))
        return p, p * (1 + lu(-8, -1, p.shape) * rng.choice([-1, 1], p.shape))
    if kind == "lopsided":
        p = np.column_stack([lu(-2, np.log10(30), n), lu(3, 15, n)])
        return p, p * (1 + rng.uniform(-0.09, 0.09, p.shape))
    raise ValueError(kind)


def scan_kl(kind, n, seed):
    rng = np.random.default_rng(seed)
    p, q = draw_pairs(kind, n, rng)
    q = np.maximum(q, 2.3e-308)
    got = Beta(p[:, 0], p[:, 1]).kl(Beta(q[:, 0], q[:, 1]))
    worst, case, over, bad = 0.0, None, 0.0, 0
    for i in range(n):
        ref, kappa = kl_ref(*p[i], *q[i])
        if not np.isfinite(got[i]):
            bad += 1
            continue
        rel = float(abs(mp.mpf(float(got[i])) - ref) / abs(ref))
        over = max(over, rel / (float(kappa) * EPS + EPS))
        if rel > worst:
            worst, case = rel, [*map(float, p[i]), *map(float, q[i]), float(ref), float(kappa)]
    return {"regime": kind, "n": n, "worst_rel": worst, "worst_case": case, "worst_over_floor": over,
            "nonfinite": bad}


def ess_ref(a, b):
    A, B = mp.mpf(float(a)), mp.mpf(float(b))
    return [float(mp.digamma(A) - mp.digamma(A + B)), float(mp.digamma(B) - mp.digamma(A + B))]


def project_ref(s1, s2, a0, b0):
    """The exact (α, β) with ψ(α) − ψ(α + β) = s1, ψ(β) − ψ(α + β) = s2 (doubles s1, s2), and its condition."""
    S1, S2 = mp.mpf(s1), mp.mpf(s2)
    f = lambda la, lb: [mp.digamma(mp.exp(la)) - mp.digamma(mp.exp(la) + mp.exp(lb)) - S1,  # noqa: E731
                        mp.digamma(mp.exp(lb)) - mp.digamma(mp.exp(la) + mp.exp(lb)) - S2]
    start = (mp.log(mp.mpf(float(a0))), mp.log(mp.mpf(float(b0))))
    la, lb = mp.findroot(f, start, tol=mp.mpf(10) ** (-2 * mp.mp.dps // 3))
    a, b = mp.exp(la), mp.exp(lb)
    t = mp.psi(1, a + b)
    J = mp.matrix([[a * (mp.psi(1, a) - t), -b * t], [-a * t, b * (mp.psi(1, b) - t)]])  # ∂s/∂(ln α, ln β)
    K = J**-1 * mp.diag([S1, S2])
    kappa = max(abs(K[0, 0]) + abs(K[0, 1]), abs(K[1, 0]) + abs(K[1, 1]))
    return a, b, kappa


def scan_project(kind, n, seed):
    rng = np.random.default_rng(seed)
    if kind == "proj_wide":
        ab = 10 ** rng.uniform(-12, 16, (n, 2))
    else:
        small, other = 10 ** rng.uniform(-12, -9, n), 10 ** rng.uniform(-3, 6, n)
        flip = rng.random(n) < 0.5
        ab = np.column_stack([np.where(flip, other, small), np.where(flip, small, other)])
    ess = np.array([ess_ref(a, b) for a, b in ab])
    got = Beta.project(ess)
    worst, case, over, bad = 0.0, None, 0.0, 0
    for i in range(n):
        a, b, kappa = project_ref(ess[i, 0], ess[i, 1], ab[i, 0], ab[i, 1])
        ga, gb = float(got.alpha[i]), float(got.beta[i])
        if not (np.isfinite(ga) and np.isfinite(gb)):
            bad += 1
            continue
        rel = float(max(abs(ga - a) / a, abs(gb - b) / b))
        over = max(over, rel / (float(kappa) * EPS + EPS))
        if rel > worst:
            worst, case = rel, [float(ab[i, 0]), float(ab[i, 1]), *map(float, ess[i]), float(kappa)]
    return {"regime": kind, "n": n, "worst_rel": worst, "worst_case": case, "worst_over_floor": over,
            "nonfinite": bad}


KL_REGIMES = ("far", "drop", "rise", "scale", "near", "mean_matched", "near_wide", "lopsided", "half")
PROJECT_REGIMES = ("proj_wide", "proj_tiny")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--n-project", type=int, default=2000, help="draws a projection regime (its failures were 0.35 %%)")
    ap.add_argument("--dps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--regimes", default=",".join(KL_REGIMES + PROJECT_REGIMES))
    ap.add_argument("--quick", action="store_true", help="40 pairs a KL regime, 200 draws a projection regime")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.n_project = min(args.n, 40), min(args.n_project, 200)
    mp.mp.dps = args.dps
    for kind in args.regimes.split(","):
        k = (KL_REGIMES + PROJECT_REGIMES).index(kind)  # (a regime's seed does not depend on which others run)
        scan = scan_project if kind.startswith("proj") else scan_kl
        with np.errstate(all="ignore"):
            n = args.n_project if kind.startswith("proj") else args.n
            print(json.dumps(scan(kind, n, args.seed + 1000 * k)), flush=True)


if __name__ == "__main__":
    main()
