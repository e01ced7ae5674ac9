#!/usr/bin/env python
"""Oracle cost and agreement on logistic-factor inputs like those EP meets.

Protocol: a batch of inputs (Gaussian x-messages with means U(−10, 10) and variances
log-uniform on [0.01, 100]; z-messages Beta(2,1) / Beta(1,2) (labels) for 80 % of rows and a
general Beta with α, β log-uniform on [0.5, 1000] for the rest).  The quadrature oracle
answers the whole batch (timed over ``--repeat`` runs, best taken); the importance-sampling
oracle (5×10^5 particles, the paper's N(0, 200) proposal) answers a subset of ``--n-is`` rows
(it costs ~tens of ms a message).  Agreement: KL[q_quad ‖ q_IS] of the beliefs on x.

Prints one JSON object per line: one per direction, then a summary holding
``quad_us_per_msg``, ``is_us_per_msg`` and ``is_vs_quad_median_kl``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kjit.factors import Logistic
from kjit.families import Beta, Gaussian
from kjit.oracles import ImportanceSamplingOracle, QuadratureOracle


def logistic_inputs(n: int, rng: np.random.Generator):
    mean = rng.uniform(-10, 10, n)
    var = np.exp(rng.uniform(np.log(0.01), np.log(100), n))
    label = rng.random(n) < 0.5
    alpha = np.where(label, 2.0, 1.0)
    beta = np.where(label, 1.0, 2.0)
    general = rng.random(n) < 0.2
    alpha = np.where(general, np.exp(rng.uniform(np.log(0.5), np.log(1000), n)), alpha)
    beta = np.where(general, np.exp(rng.uniform(np.log(0.5), np.log(1000), n)), beta)
    return {"x": Gaussian(mean, var), "z": Beta(alpha, beta)}


def best_time(fn, repeat):
    best = np.inf
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="batch size for quadrature (default 2000)")
    ap.add_argument("--n-is", type=int, default=200, help="rows answered by importance sampling (default 200)")
    ap.add_argument("--particles", type=int, default=500_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.n_is, args.repeat = 1000, 20, 1

    rng = np.random.default_rng(args.seed)
    inc = logistic_inputs(args.n, rng)
    factor = Logistic()
    quad = QuadratureOracle(factor)
    is_oracle = ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=args.seed)
    sub = {v: m[: args.n_is] for v, m in inc.items()}
    summary = {"benchmark": "oracles", "n": args.n, "n_is": args.n_is, "particles": args.particles}
    for to in ("x", "z"):
        t_quad, q = best_time(lambda: quad.belief(inc, to), args.repeat)
        t_is, qi = best_time(lambda: is_oracle.belief(sub, to), 1)
        kl = q[: args.n_is].kl(qi)
        row = {
            "direction": to,
            "quad_us_per_msg": 1e6 * t_quad / args.n,
            "is_us_per_msg": 1e6 * t_is / args.n_is,
            "is_vs_quad_median_kl": float(np.median(kl)),
            "is_vs_quad_p90_kl": float(np.quantile(kl, 0.9)),
            "is_min_ess": float(np.min(is_oracle.last_ess_)),
            "is_over_quad_cost": t_is / args.n_is / (t_quad / args.n),
        }
        print(json.dumps(row), flush=True)
        if to == "x":
            summary.update({k: row[k] for k in ("quad_us_per_msg", "is_us_per_msg", "is_vs_quad_median_kl")})
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
