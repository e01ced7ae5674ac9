#!/usr/bin/env python
"""Oracle cost and agreement on logistic-factor inputs like those EP meets.

Protocol: a batch of inputs (Gaussian x-messages with means U(−10, 10) and variances
log-uniform on [0.01, 100]; z-messages Beta(2,1) / Beta(1,2) (labels) for 80 % of rows and a
general Beta with α, β log-uniform on [0.5, 1000] for the rest).  The quadrature oracle
answers the whole batch (timed over ``--repeat`` runs, best taken); the importance-sampling
oracle (5×10^5 particles, the paper's N(0, 200) proposal) answers a subset of ``--n-is`` rows
(it costs ~tens of ms a message).  Agreement: KL[q_quad ‖ q_IS] of the beliefs on x.

Second part (``--samplers``, on by default): the two importance samplers on every multi-input
factor (product, gaussian, gamma_rate, exp), every direction, ``--n-s`` rows drawn from the
factor's default training distribution (``Factor.default_incoming``), each against the factor's
exact rule: the paper's shared fixed proposal (:class:`ImportanceSamplingOracle`, one particle
draw for the batch, 10^5 and 5×10^5 particles) and the per-message proposal
(:class:`MessageImportanceSampler`: inputs from their own messages, weight by the output's;
adaptive to a target standard error of 3e-2 and 1e-2 per coordinate, cap 2.56×10^5).  Per
(factor, direction, sampler, setting): µs per message, failure rate (ESS < 50), median KL and mean
log KL[exact ‖ sampled] over the rows that did not fail, mean particles per message.  Accuracy is
matched by reading the rows: the per-message setting against the shared setting of equal or better
median KL.

Prints one JSON object per line: one per direction, then a summary holding
``quad_us_per_msg``, ``is_us_per_msg`` and ``is_vs_quad_median_kl``; then the sampler rows and a
last summary ``samplers`` with, per factor→direction, the per-message sampler's mean log KL at
target 1e-2 and the shared proposal's at 5×10^5.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kjit.factors import Logistic, get_factor
from kjit.families import Beta, Gaussian
from kjit.oracles import ImportanceSamplingOracle, MessageImportanceSampler, QuadratureOracle

NEW_FACTORS = ("product", "gaussian", "gamma_rate", "exp")


def _shared(factor, inc, to, n, seed):
    """The shared-proposal sampler on a batch: (beliefs or None per row, failed mask, seconds)."""
    o = ImportanceSamplingOracle(factor, n_samples=n, random_state=seed)
    t = time.perf_counter()
    stats, ess = o.estimate(inc, to)
    fam = factor.families[to]
    failed = ~(ess >= o.min_ess)
    if fam is Gaussian:
        failed |= ~(stats[:, 1] > 0)
    ok = np.flatnonzero(~failed)
    q = None
    if ok.size:
        q = Gaussian(stats[ok, 0], stats[ok, 1]) if fam is Gaussian else fam.project(stats[ok])
    return q, failed, time.perf_counter() - t


def _per_message(factor, inc, to, target_se, seed):
    o = MessageImportanceSampler(factor, target_se=target_se, random_state=seed)
    t = time.perf_counter()
    stats, ess, se, n_used, _ = o.estimate(inc, to)
    failed = ~(ess >= o.min_ess)
    ok = np.flatnonzero(~failed)
    q = factor.families[to].project(stats[ok]) if ok.size else None
    return q, failed, time.perf_counter() - t, float(np.mean(n_used))


def sampler_rows(args):
    rng = np.random.default_rng(args.seed + 1)
    best = {}
    shared_n = (100_000,) if args.quick else (100_000, 500_000)
    targets = (3e-2,) if args.quick else (3e-2, 1e-2)
    for name in NEW_FACTORS:
        f = get_factor(name)
        inc = f.default_incoming(args.n_s, rng)
        exact = QuadratureOracle(f)
        for to in f.variables:
            q_ex = exact.belief(inc, to)
            runs = [("shared", n, *_shared(f, inc, to, n, args.seed), float(n)) for n in shared_n]
            runs += [("per_message", t, *_per_message(f, inc, to, t, args.seed)) for t in targets]
            for kind, setting, q, failed, secs, particles in runs:
                ok = np.flatnonzero(~failed)
                kl = q_ex[ok].kl(q) if ok.size else np.array([np.nan])
                row = {"factor": name, "direction": to, "sampler": kind,
                       ("particles" if kind == "shared" else "target_se"): setting,
                       "us_per_msg": 1e6 * secs / args.n_s, "failure_rate": float(np.mean(failed)),
                       "median_kl": float(np.median(kl)), "mean_log_kl": float(np.mean(np.log(np.maximum(kl, 1e-300)))),
                       "mean_particles": particles}
                print(json.dumps(row), flush=True)
                best.setdefault(f"{name}->{to}", {})[f"{kind}_{setting:g}"] = row["mean_log_kl"]
    print(json.dumps({"samplers": True, "n_s": args.n_s, "mean_log_kl": best}), flush=True)


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
    ap.add_argument("--n-s", type=int, default=100, help="rows per factor direction for the samplers (default 100)")
    ap.add_argument("--no-samplers", action="store_true", help="skip the multi-input samplers part")
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.n_is, args.repeat, args.n_s = 1000, 20, 1, 12

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
    if not args.no_samplers:
        sampler_rows(args)


if __name__ == "__main__":
    main()
