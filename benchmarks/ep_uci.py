"""EP logistic regression on four UCI data sets: quadrature vs importance-sampling operator.

Protocol (KJIT paper, §8 of SPEC): stratified paper split (200 training points; fertility 50;
the rest for test), features standardised on the training part plus a bias column, prior
w ~ N(0, I), labels through Beta(2,1)/Beta(1,2) into the Logistic factor, parallel EP schedule
(one batched operator call of n_train messages per iteration).  Two operators:

* ``QuadratureOracle(Logistic())`` — the deterministic "hand-crafted" baseline;
* ``ImportanceSamplingOracle(Logistic(), n_samples=5e5)`` — the paper's sampling oracle
  (proposal N(0, 200)).  Its messages are noisy, so EP with it does not reach a small ``tol``;
  its iterations are capped at ``--is-max-iter`` (default 15) and the JSON says whether the cap
  was hit (``is_iterations_capped``).

One JSON object per data set on stdout.  ``--quick`` uses 2e4 particles and at most 5 IS
iterations (a < 1 min smoke run; its IS numbers are *not* the paper setting).

    python benchmarks/ep_uci.py [--quick] [--datasets banknote fertility] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kjit.datasets import paper_split
from kjit.ep import BayesianLogisticRegression
from kjit.factors import Logistic
from kjit.oracles import ImportanceSamplingOracle, QuadratureOracle

DATASETS = ("banknote", "blood_transfusion", "fertility", "ionosphere")


def run_one(name, args):
    split = paper_split(name, random_state=args.seed, add_bias=True)
    Xtr, ytr, Xte, yte = split.X_train, split.y_train, split.X_test, split.y_test
    common = dict(prior_var=1.0, damping=args.damping, schedule="parallel")

    t0 = time.perf_counter()
    quad = BayesianLogisticRegression(QuadratureOracle(Logistic()), tol=args.tol, max_iter=args.max_iter, **common)
    quad.fit(Xtr, ytr)
    seconds = time.perf_counter() - t0
    err = quad.test_error(Xte, yte)

    is_op = ImportanceSamplingOracle(Logistic(), n_samples=args.is_samples, random_state=args.seed)
    t0 = time.perf_counter()
    smp = BayesianLogisticRegression(is_op, tol=args.tol, max_iter=args.is_max_iter, **common)
    smp.fit(Xtr, ytr)
    seconds_is = time.perf_counter() - t0
    err_is = smp.test_error(Xte, yte)

    sd = np.sqrt(np.diag(quad.posterior_.cov))
    r_q, r_s = quad.result_, smp.result_
    return {
        "dataset": name,
        "n_train": int(len(ytr)),
        "n_test": int(len(yte)),
        "d": int(Xtr.shape[1]),
        "test_error": err,
        "iterations": r_q.iterations,
        "seconds": round(seconds, 3),
        "converged": r_q.converged,
        "log_evidence": quad.log_evidence_,
        "n_skipped": r_q.n_skipped,
        "test_error_is": err_is,
        "seconds_is": round(seconds_is, 3),
        "iterations_is": r_s.iterations,
        "converged_is": r_s.converged,
        "is_iterations_capped": (not r_s.converged) and r_s.iterations == args.is_max_iter,
        "is_max_iter": args.is_max_iter,
        "is_n_samples": args.is_samples,
        "n_skipped_is": r_s.n_skipped,
        "last_max_change_is": r_s.history[-1].max_change,
        "is_mean_diff_in_sd": float(np.max(np.abs(smp.coef_ - quad.coef_) / sd)),
        "is_sd_ratio_max_dev": float(np.max(np.abs(np.sqrt(np.diag(smp.posterior_.cov)) / sd - 1.0))),
        "tol": args.tol,
        "damping": args.damping,
        "seed": args.seed,
        "quick": args.quick,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2e4 IS particles, at most 5 IS iterations")
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    p.add_argument("--seed", type=int, default=0, help="split and IS seed")
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--max-iter", type=int, default=200)
    p.add_argument("--damping", type=float, default=0.0)
    p.add_argument("--is-samples", type=int, default=None, help="IS particles (default 5e5, quick 2e4)")
    p.add_argument("--is-max-iter", type=int, default=None, help="IS iteration cap (default 15, quick 5)")
    args = p.parse_args(argv)
    if args.is_samples is None:
        args.is_samples = 20_000 if args.quick else 500_000
    if args.is_max_iter is None:
        args.is_max_iter = 5 if args.quick else 15
    for name in args.datasets:
        print(json.dumps(run_one(name, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
