#!/usr/bin/env python
"""Soak runs: many random EP problems, none may crash or return NaN; divergence must be reported.

Protocol
--------
Three soaks, each one JSON line with its counts by outcome (``converged``, ``max_iter``,
``diverged``), the problems run and the wall seconds; a problem that crashes, returns a non-finite
posterior or prediction, or reports its outcome wrongly stops the run with the failing problem's
index, its data and parameters (an ``AssertionError``, exit status 1):

* ``graphs`` — random small factor graphs (1–4 Gaussian/Gamma variables, 1–6 factors drawn from
  the registry, each variable bound or given a random message), ``GraphEP`` with exact rules, at
  most 3 iterations, damping 0 or 0.5, a parallel or sequential schedule (issue 15: "1 000 randomly
  generated small graphs run with no crash and no NaN; a run that diverges says so"); seed 2026;
* ``poor_learned`` — Bayesian logistic regression on random problems (1–24 points, 1–4 weights,
  inputs scaled by 10^U(−2, 1.5), prior variance 10^U(−1, 2)) through a deliberately small learned
  operator (200 pairs, D 30/60), every other problem through a perturbed copy of it (belief mean
  moved by up to 0.5 cavity sd, log variance scaled by a factor in [0.5, 2]); seed 2026;
* ``variants`` — the same kind of random problems through every EP variant (EP, power EP, relaxed
  EP, Laplace propagation, their logistic-factor forms on every 10th problem, and GP
  classification's EP, power EP and relaxed EP); seed 2024.

The problem generators and checks are the test suite's own (``tests/test_ep_graph.py``,
``tests/test_ep_learned.py``, ``tests/test_ep_variants_robust.py``), which run small versions of
these soaks (15 graphs, 60 problems, 54 runs) on every CI run; the 1 000-problem runs were slow
tests until CI's machine made them too long for its time limit, so they live here.

    python benchmarks/soak.py [--quick] [--n 1000] [--soaks graphs poor_learned variants]

``--quick``: 100 problems per soak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
SOAKS = ("graphs", "poor_learned", "variants")


def _graphs(n):
    from test_ep_graph import _check_random_graphs

    out = _check_random_graphs(n, seed=2026, max_iter=3)
    # a random graph whose factors bind no variable is not run: the slow test allowed at most 100 of 1000
    # (a bound for the full soak; on a few dozen graphs the share skipped is too noisy to bound)
    if n >= 1000:
        assert sum(out.values()) > 0.9 * n, out
    return out


def _poor_learned(n):
    from test_ep_learned import _check_random, small_op

    out = _check_random(n, seed=2026, op=small_op.__wrapped__())
    assert sum(out.values()) == n, out  # every problem ran to an outcome
    return out


def _variants(n):
    from threadpoolctl import threadpool_limits
    from test_ep_variants_robust import METHODS, _check

    # one BLAS thread, as the test file's autouse fixture gives its tests: tiny matrices
    with threadpool_limits(limits=1, user_api="blas"):
        not_converged = _check(n, seed=2024, methods=METHODS)
    # divergences are allowed (and reported per run); crashes and NaN are not; no method never converges
    assert all(c < n for c in not_converged.values()), not_converged
    return {"not_converged_by_method": not_converged}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="problems per soak (default 1000)")
    ap.add_argument("--soaks", nargs="+", choices=SOAKS, default=list(SOAKS))
    ap.add_argument("--quick", action="store_true", help="100 problems per soak")
    args = ap.parse_args(argv)
    if args.quick:
        args.n = 100
    sys.path.insert(0, str(TESTS))
    run = {"graphs": _graphs, "poor_learned": _poor_learned, "variants": _variants}
    for name in args.soaks:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            counts = run[name](args.n)
        print(json.dumps({"soak": name, "n_problems": args.n, **counts, "crashes": 0, "nonfinite": 0,
                          "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
