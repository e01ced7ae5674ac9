#!/usr/bin/env python
"""The KJIT paper's online experiment on synthetic logistic regression.

30 problems in sequence (d = 20, n = 300 training points, 1000 test points; w, a ~ N(0, I)),
up to 10 parallel-schedule EP iterations each; one JIT operator for the logistic factor
(message to x) with the importance-sampling oracle (5×10^5 particles, N(0, 200) proposal),
starting from no operator (the first ``--initial-batch`` messages go to the oracle).  The
same problems with importance sampling alone and with quadrature.  See jit_common.py for the
protocol details (importance sampling alone is measured on ``--is-problems`` problems and
projected from its per-message cost for the others).

Paper: KJIT ≈ 35× faster than sampling alone, 10–30× slower than the hand-crafted operator,
same test error.  Targets: ≥ 50× faster than sampling over problems 2–30, within 3× of
quadrature-EP, test error within 0.01 of quadrature-EP.

One JSON object per problem, then a summary.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from jit_common import add_args, emit, run_sequence, summarise  # noqa: E402

from kjit.datasets import synthetic_logistic  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=30)
    ap.add_argument("--d", type=int, default=20)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--is-problems", default="0,1,2",
                    help="indices of problems also solved by importance sampling alone")
    ap.add_argument("--quick", action="store_true", help="4 small problems, 2x10^4 particles")
    add_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.problems, args.n, args.particles, args.initial_batch = 4, 100, 20_000, 150
        args.d_in, args.d_out = 100, 200
    problems, names = [], []
    for k in range(args.problems):
        X, y, Xt, yt, _ = synthetic_logistic(d=args.d, n=args.n, n_test=1000, random_state=1000 + k)
        problems.append((X, y, Xt, yt))
        names.append(f"synthetic-{k + 1}")
    is_problems = {int(v) for v in args.is_problems.split(",") if v != ""}
    rows, per_msg, jit = run_sequence(problems, names, args, is_problems)
    summary = summarise(rows, per_msg, jit, first=1)
    emit({"benchmark": "jit_synthetic", "problems": args.problems, "particles": args.particles,
          "threshold": args.threshold, **summary})


if __name__ == "__main__":
    main()
