#!/usr/bin/env python
"""Exact rules of the multi-input factors (kjit.exact): cost per message and agreement with an
independent computation, per (factor, direction[, projection]).

Protocol
--------
For each factor, a batch of ``--n`` random incoming-message sets (seed ``--seed``) spanning broad
and nearly point-mass messages:

* product:    means U(−5, 5), variances log-uniform [1e-4, 1e2] for x, y, z; the x mean is 0 in
              a fifth of the rows (an input centred at 0);
* gaussian:   m, x means U(−5, 5), variances log-uniform [1e-3, 1e2]; tau shape log-uniform
              [0.05, 100], rate log-uniform [0.01, 100];
* gamma_rate: shape parameter 1 (default); r, x shapes log-uniform [0.1, 100], rates
              log-uniform [0.01, 100];
* exp:        x mean U(−5, 5), variance log-uniform [1e-4, 100]; y shape log-uniform [0.1, 100],
              rate log-uniform [0.01, 100].

Cost: ``belief(to, batch)`` on the whole batch, best of ``--repeat`` runs, in µs per message
(one vectorised call).  Agreement: on the first ``--n-check`` rows, the largest relative error of
the belief's parameters against :func:`kjit.exact.reference.reference` (a different reduction of
the same integral by scipy's adaptive ``quad_vec``; a Gaussian mean relative to max(|mean|, sd)).
Gamma recipients are measured under both projections ("kl", the default, and "moments").

``--wide``: a harder sweep — means U(−20, 20) (0 in 30 % of rows), variances log-uniform
[1e-8, 1e4], Gamma shapes [1e-2, 1e5] and rates [1e-3, 1e3] for every factor (shape parameter
1).  Rows whose belief is not representable in double precision (e.g. exp's Gamma belief when
the tilted x sits near −5000) are an OracleError naming them; they are dropped, counted in
``n_oracle_error``, and the timing repeated on the rest.  Conflicting messages there (z pinning
x·y against narrow inputs, tilted modes 10^4 message-sds away) have log-densities ~1e8 whose
rounding limits the reference itself (its tolerance is max(1e-12, 1e-15·|log w|)).

Prints one JSON object per line: one per (factor, to, projection) with ``us_per_msg``,
``max_rel_error``, ``n``, ``n_checked`` (rows where the reference itself failed are counted in
``n_reference_failed``, over both projections); the last line is the summary with ``n_factors``,
``n_directions`` and ``max_rel_error`` (over every line).  ``--quick``: n = 500, 5 checked rows,
1 repeat (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kjit.exact import FACTORS
from kjit.exact.reference import reference, rel_error
from kjit.families import Gamma, Gaussian
from kjit.oracles import OracleError


def _logu(rng, lo, hi, n):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n))


def wide_inputs(name: str, n: int, rng: np.random.Generator) -> dict:
    def g():
        return Gaussian(rng.uniform(-20, 20, n) * (rng.random(n) < 0.7), _logu(rng, 1e-8, 1e4, n))

    def ga():
        return Gamma(_logu(rng, 1e-2, 1e5, n), _logu(rng, 1e-3, 1e3, n))

    fams = FACTORS[name].FAMILIES
    return {v: (g() if fam is Gaussian else ga()) for v, fam in fams.items()}


def inputs(name: str, n: int, rng: np.random.Generator) -> dict:
    if name == "product":
        mx = rng.uniform(-5, 5, n)
        mx[rng.random(n) < 0.2] = 0.0
        return {
            "x": Gaussian(mx, _logu(rng, 1e-4, 1e2, n)),
            "y": Gaussian(rng.uniform(-5, 5, n), _logu(rng, 1e-4, 1e2, n)),
            "z": Gaussian(rng.uniform(-5, 5, n), _logu(rng, 1e-4, 1e2, n)),
        }
    if name == "gaussian":
        return {
            "m": Gaussian(rng.uniform(-5, 5, n), _logu(rng, 1e-3, 1e2, n)),
            "tau": Gamma(_logu(rng, 0.05, 100, n), _logu(rng, 0.01, 100, n)),
            "x": Gaussian(rng.uniform(-5, 5, n), _logu(rng, 1e-3, 1e2, n)),
        }
    if name == "gamma_rate":
        return {
            "r": Gamma(_logu(rng, 0.1, 100, n), _logu(rng, 0.01, 100, n)),
            "x": Gamma(_logu(rng, 0.1, 100, n), _logu(rng, 0.01, 100, n)),
        }
    if name == "exp":
        return {
            "x": Gaussian(rng.uniform(-5, 5, n), _logu(rng, 1e-4, 100, n)),
            "y": Gamma(_logu(rng, 0.1, 100, n), _logu(rng, 0.01, 100, n)),
        }
    raise ValueError(name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="messages per batch (default 2000)")
    ap.add_argument("--n-check", type=int, default=25, help="rows checked against the reference (default 25)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="n=500, 5 checked rows, 1 repeat")
    ap.add_argument("--wide", action="store_true", help="the harder sweep (see the protocol)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.n_check, args.repeat = 500, 5, 1
    rng = np.random.default_rng(args.seed)
    worst = 0.0
    n_dir = 0
    for name, mod in FACTORS.items():
        inc = (wide_inputs if args.wide else inputs)(name, args.n, rng)
        # drop rows whose beliefs are not representable (an OracleError names them)
        n_err = 0
        for to in mod.FAMILIES:
            for projection in ("kl", "moments"):
                while True:
                    try:
                        mod.belief(to, inc, projection=projection)
                        break
                    except OracleError as err:
                        keep = np.setdiff1d(np.arange(len(next(iter(inc.values())))), err.rows)
                        n_err += len(err.rows)
                        inc = {v: m[keep] for v, m in inc.items()}
        n = len(next(iter(inc.values())))
        k = min(args.n_check, n)
        refs = {}
        n_ref_fail = 0
        for projection in ("kl", "moments"):
            refs[projection] = []
            for i in range(k):
                try:
                    refs[projection].append(reference(name, {v: m[i] for v, m in inc.items()}, projection))
                except Exception:  # the reference's own limits (reported, never hidden)
                    refs[projection].append(None)
                    n_ref_fail += 1
        for to, fam in mod.FAMILIES.items():
            n_dir += 1
            for projection in (("kl", "moments") if fam is Gamma else ("kl",)):
                best, q = np.inf, None
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    q = mod.belief(to, inc, projection=projection)
                    best = min(best, time.perf_counter() - t0)
                errs = [rel_error(q[i], refs[projection][i][1][to]) for i in range(k) if refs[projection][i]]
                err = max(errs, default=float("nan"))
                worst = max(worst, err) if errs else worst
                print(json.dumps({
                    "factor": name, "to": to, "projection": projection, "n": n,
                    "n_oracle_error": n_err, "us_per_msg": round(best / n * 1e6, 2), "n_checked": len(errs),
                    "max_rel_error": float(f"{err:.3g}"), "n_reference_failed": n_ref_fail,
                }), flush=True)
    print(json.dumps({
        "summary": True, "n_factors": len(FACTORS), "n_directions": n_dir,
        "max_rel_error": float(f"{worst:.3g}"), "seed": args.seed, "n": args.n, "wide": args.wide,
    }), flush=True)


if __name__ == "__main__":
    main()
