"""Shared protocol of the just-in-time benchmarks (jit_synthetic.py, jit_uci.py).

A sequence of logistic-regression problems is solved by parallel-schedule EP three ways:
with one JIT operator (learned operator + importance-sampling oracle, shared across the whole
sequence and learning as it goes), with the importance-sampling oracle alone, and with the
quadrature oracle (the hand-crafted operator and the accuracy reference).  Per problem: EP
seconds, operator requests and consultations, test error.  Importance sampling alone costs
minutes per problem at 5×10^5 particles, so it runs on ``--is-problems`` of them; for the
others its cost is projected from the measured seconds per requested message times the
messages quadrature-EP requested on that problem (every such row says ``is_measured``).
"""

from __future__ import annotations

import json
import time

import numpy as np

from kjit.ep.models import BayesianLogisticRegression
from kjit.factors import Logistic
from kjit.operators import JITOperator
from kjit.oracles import ImportanceSamplingOracle, QuadratureOracle


def emit(obj):
    print(json.dumps(obj), flush=True)


class CountingOperator:
    """Counts the messages an operator is asked for (for the oracle-alone runs)."""

    def __init__(self, operator):
        self.operator = operator
        self.requests = 0

    def belief(self, incoming, to):
        self.requests += int(np.prod(next(iter(incoming.values())).shape))
        return self.operator.belief(incoming, to)


def run_ep(operator, X, y, X_test, y_test, max_iter):
    t = time.perf_counter()
    model = BayesianLogisticRegression(operator, max_iter=max_iter, compute_evidence=False).fit(X, y)
    seconds = time.perf_counter() - t
    return model, seconds, model.test_error(X_test, y_test)


def add_args(ap):
    ap.add_argument("--particles", type=int, default=500_000, help="importance-sampling particles")
    ap.add_argument("--threshold", type=float, default=-8.5,
                    help="JIT threshold on log predictive variance (paper: -8.5 synthetic, -8.95 UCI)")
    ap.add_argument("--initial-batch", type=int, default=300)
    ap.add_argument("--target-kl", type=float, default=None,
                    help="derive the threshold from this mean KL on a held-out quarter of the initial batch")
    ap.add_argument("--d-in", type=int, default=300)
    ap.add_argument("--d-out", type=int, default=500)
    ap.add_argument("--max-iter", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)


def run_sequence(problems, names, args, is_problems):
    """Solve ``problems`` (list of (X, y, X_test, y_test)) in order; emit rows and return a summary."""
    factor = Logistic()
    quad = QuadratureOracle(factor)
    is_oracle = ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=args.seed)
    jit = JITOperator(
        None, ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=args.seed + 1),
        threshold=args.threshold, initial_batch=args.initial_batch, to="x", target_kl=args.target_kl,
        operator_kwargs={"n_inner": args.d_in, "n_outer": args.d_out, "random_state": args.seed,
                         "dtype": "float32"},
    )
    rows = []
    is_rate = None  # measured IS seconds per requested message
    for k, ((X, y, Xt, yt), name) in enumerate(zip(problems, names)):
        before = jit.counters()
        _, s_jit, e_jit = run_ep(jit, X, y, Xt, yt, args.max_iter)
        after = jit.counters()
        q = CountingOperator(quad)
        _, s_quad, e_quad = run_ep(q, X, y, Xt, yt, args.max_iter)
        row = {
            "problem": name, "index": k, "n_train": len(y),
            "jit_seconds": s_jit, "jit_requests": after["requests"] - before["requests"],
            "jit_consultations": after["consultations"] - before["consultations"],
            "jit_test_error": e_jit,
            "quad_seconds": s_quad, "quad_requests": q.requests, "quad_test_error": e_quad,
        }
        if k in is_problems:
            c = CountingOperator(is_oracle)
            _, s_is, e_is = run_ep(c, X, y, Xt, yt, args.max_iter)
            row.update({"is_seconds": s_is, "is_requests": c.requests, "is_test_error": e_is, "is_measured": True})
            total = (is_rate[0] if is_rate else 0.0) + s_is, (is_rate[1] if is_rate else 0) + c.requests
            is_rate = total
        else:
            row["is_measured"] = False
        rows.append(row)
        emit(row)
    per_msg = is_rate[0] / is_rate[1] if is_rate else None
    for r in rows:
        if not r["is_measured"]:
            r["is_seconds"] = per_msg * r["quad_requests"] if per_msg else None
    return rows, per_msg, jit


def summarise(rows, per_msg, jit, first=1):
    def total(key, rs):
        return float(sum(r[key] for r in rs))

    later = rows[first:]
    c = jit.counters()
    out = {
        "is_us_per_msg": None if per_msg is None else 1e6 * per_msg,
        "is_problems_measured": [r["problem"] for r in rows if r["is_measured"]],
        "speedup_vs_sampling": total("is_seconds", rows) / total("jit_seconds", rows),
        "speedup_vs_sampling_after_first": total("is_seconds", later) / total("jit_seconds", later),
        "jit_over_quad_after_first": total("jit_seconds", later) / total("quad_seconds", later),
        "threshold_used": jit.threshold,
        "consultation_rate": c["consultation_rate"],
        "consultation_rate_after_first": total("jit_consultations", later) / max(1.0, total("jit_requests", later)),
        "max_test_error_gap_vs_quad": float(max(abs(r["jit_test_error"] - r["quad_test_error"]) for r in rows)),
        "jit_counters": c,
    }
    return out
