#!/usr/bin/env python
"""Four UCI data sets in sequence with one JIT operator (KJIT paper, SPEC §8).

banknote, blood transfusion, fertility, ionosphere; the papers' split (200 stratified
training points per set, fertility 50; the rest for test), standardised features plus a
bias column; up to 10 parallel-schedule EP iterations each.  One JIT operator (importance
sampling, 5×10^5 particles) starting from no operator, learning across the sequence; the same
with importance sampling alone and with quadrature.  See jit_common.py.

Paper: sampling+KJIT only 1.3–2.3× faster than sampling alone.  Targets: ≥ 10× over the whole
sequence, ≥ 30× over the last three data sets, consultations < 2 % of requests after the first
data set, test error within 0.01 of quadrature-EP on each.

One JSON object per data set, then a summary holding ``speedup_vs_sampling``,
``speedup_vs_sampling_last3`` and ``consultation_rate_after_first``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from jit_common import add_args, emit, run_sequence, summarise  # noqa: E402

from kjit.datasets import paper_split  # noqa: E402

DATASETS = ("banknote", "blood_transfusion", "fertility", "ionosphere")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--is-problems", default="0,1,2,3",
                    help="indices of data sets also solved by importance sampling alone (default: all)")
    ap.add_argument("--quick", action="store_true", help="2x10^4 particles, smaller operator")
    add_args(ap)
    # initial batch 200: EP's first sweep of banknote (200 messages, every cavity mean 0), and the
    # fit waits for 200 // 4 = 50 messages of the second sweep (JITOperator), so it is fitted on
    # 250 pairs; the rest of that sweep goes through the fitted operator
    ap.set_defaults(threshold=-8.95, initial_batch=200)
    args = ap.parse_args(argv)
    if args.quick:
        args.particles, args.d_in, args.d_out = 20_000, 100, 200
    problems = []
    for name in DATASETS:
        sp = paper_split(name, random_state=args.seed, add_bias=True)
        problems.append((sp.X_train, sp.y_train, sp.X_test, sp.y_test))
    is_problems = {int(v) for v in args.is_problems.split(",") if v != ""}
    rows, per_msg, jit = run_sequence(problems, list(DATASETS), args, is_problems)
    summary = summarise(rows, per_msg, jit, first=1)
    summary["speedup_vs_sampling_last3"] = summary.pop("speedup_vs_sampling_after_first")
    emit({"benchmark": "jit_uci", "particles": args.particles, "threshold": args.threshold, **summary})


if __name__ == "__main__":
    main()
