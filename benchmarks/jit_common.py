"""Shared protocol of the just-in-time benchmarks (jit_synthetic.py, jit_uci.py).

A sequence of logistic-regression problems is solved by parallel-schedule EP three ways:
with one JIT operator (learned operator + importance-sampling oracle, shared across the whole
sequence and learning as it goes), with the importance-sampling oracle alone, and with the
quadrature oracle (the hand-crafted operator and the accuracy reference).  Per problem: EP
seconds (wall clock), operator requests and consultations, test error.

Importance sampling alone costs ~7 ms per message at 5×10^5 particles, so it runs on
``--is-problems`` of them; for the others its cost is projected as (total measured IS seconds
/ total messages IS requested on the measured problems) × the messages quadrature-EP requested
on that problem — every row says ``is_measured``.  The measured rate includes IS's fixed cost
per call (one particle draw per EP sweep).  With ``max_iter`` = 10 every EP run here uses all
10 sweeps (the IS and JIT answers are noisy or differ by ~1e-6, so the 1e-6 tolerance is never
met; quadrature-EP requests the same number of messages as measured IS-EP on the measured
problems), so the projection counts the messages IS would be asked for.

Both importance samplers (the JIT's and sampling alone) serve ``--reuse`` (default 10) consecutive
calls from one particle draw — one draw per EP run of 10 sweeps: a draw and its statistics cost
~40–65 ms whatever the batch, which dominates the JIT's small consultations (a few rows) and is
negligible for sampling alone (hundreds of rows per call); ``--reuse 1`` draws afresh every call.

All methods run in one process with the same settings: BLAS limited to ``--blas-threads``
(default 1: the matrices are small and the machine is shared) and glibc told to keep freed
memory (:func:`keep_freed_memory`; ``--malloc-default`` to switch that off).
"""

from __future__ import annotations

import ctypes
import json
import time

import numpy as np

from kjit.ep.models import BayesianLogisticRegression
from kjit.factors import Logistic
from kjit.operators import REFERENCES, WIDTH_RULES, JITOperator
from kjit.oracles import ImportanceSamplingOracle, QuadratureOracle


def emit(obj):
    print(json.dumps(obj), flush=True)


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory in the process instead of returning it to the kernel.

    By default glibc serves blocks above ~128 KB (dynamically up to 32 MB) with fresh mmaps
    and trims the heap top, so nearly every large numpy temporary is new memory whose pages
    fault in on first touch; on this VM that costs ~1 ms per 4 MB, which is most of the
    importance-sampling oracle's fixed cost per call (5×10^5 particles: 99 → 39 ms with this
    setting, measured).  It changes no result; it is set once per process, so every method of
    a benchmark (JIT, importance sampling alone, quadrature) runs with it.  Returns whether
    glibc accepted it (False elsewhere: a no-op).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


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
    model = BayesianLogisticRegression(operator, max_iter=max_iter, compute_evidence=False, damping=0.0,
                                       warn_unconverged=False).fit(X, y)  # (the paper's fixed sweeps)
    seconds = time.perf_counter() - t
    return model, seconds, model.test_error(X_test, y_test)


def operator_errors(model) -> int:
    """Site updates the EP engine skipped because the operator raised (e.g. an importance-sampling
    ESS failure): the engine records them and carries on, so the rows report them."""
    return int(sum(rec.skipped.get("operator_error", 0) for rec in model.result_.history))


def add_args(ap):
    ap.add_argument("--particles", type=int, default=500_000, help="importance-sampling particles")
    ap.add_argument("--reuse", type=int, default=10,
                    help="calls one importance-sampling particle draw serves, for both the JIT's oracle and "
                         "sampling alone (ImportanceSamplingOracle(reuse=...); 1: a fresh draw per call)")
    ap.add_argument("--threshold", type=float, default=-8.5,
                    help="JIT threshold on log predictive variance (paper: -8.5 synthetic, -8.95 UCI)")
    ap.add_argument("--initial-batch", type=int, default=300,
                    help="JIT initial batch (the fit also waits for initial_batch // 4 messages that "
                         "vary in every coordinate: EP's first sweep has every cavity mean 0)")
    ap.add_argument("--target-kl", type=float, default=None,
                    help="derive the threshold from this mean KL on a held-out quarter of the initial batch")
    ap.add_argument("--d-in", type=int, default=300)
    ap.add_argument("--d-out", type=int, default=500)
    ap.add_argument("--max-iter", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", default="auto", choices=REFERENCES,
                    help="what the operator's relative targets are relative to (KernelOperator's `reference`)")
    ap.add_argument("--width-rules", nargs="+", default=list(WIDTH_RULES), choices=WIDTH_RULES,
                    help="inner-width rules the JIT operator's evidence search may choose from (KernelOperator)")
    ap.add_argument("--malloc-default", action="store_true",
                    help="leave glibc's memory return policy alone (see keep_freed_memory)")
    ap.add_argument("--blas-threads", type=int, default=1, help="BLAS threads for every method (0: library default)")
    ap.add_argument("--selection", choices=("greedy", "all"), default="greedy",
                    help="which uncertain rows of a request the JIT sends to the oracle (JITOperator)")
    ap.add_argument("--guard-share", type=float, default=None,
                    help="also consult rows whose density to the learned rows is below this share of the initial "
                         "batch's (JITOperator(guard_share=...); default: no density guard)")
    ap.add_argument("--input-margin", type=float, default=None,
                    help="also consult, and do not learn, rows beyond this many widths of the initial batch's "
                         "input range (JITOperator(input_margin=...); default: none)")


def process_settings(args):
    """Apply --malloc-default / --blas-threads; returns the threadpool limiter to keep alive."""
    if not getattr(args, "malloc_default", False):
        keep_freed_memory()
    if getattr(args, "blas_threads", 0) > 0:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # pragma: no cover - optional
            return None
        return threadpool_limits(limits=args.blas_threads, user_api="blas")
    return None


def run_sequence(problems, names, args, is_problems):
    """Solve ``problems`` (list of (X, y, X_test, y_test)) in order; emit rows and return a summary."""
    limits = process_settings(args)  # noqa: F841 - kept alive for the whole run
    factor = Logistic()
    quad = QuadratureOracle(factor)
    reuse = getattr(args, "reuse", 1)
    is_oracle = ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=args.seed, reuse=reuse)
    jit = JITOperator(
        None, ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=args.seed + 1, reuse=reuse),
        threshold=args.threshold, initial_batch=args.initial_batch, to="x", target_kl=args.target_kl,
        selection=getattr(args, "selection", "greedy"), guard_share=getattr(args, "guard_share", None),
        input_margin=getattr(args, "input_margin", None),
        operator_kwargs={"n_inner": args.d_in, "n_outer": args.d_out, "random_state": args.seed,
                         "dtype": "float32", "width_rules": tuple(getattr(args, "width_rules", WIDTH_RULES)),
                         "reference": getattr(args, "reference", "auto")},
    )
    rows = []
    is_rate = None  # measured IS seconds per requested message
    for k, ((X, y, Xt, yt), name) in enumerate(zip(problems, names)):
        before = jit.counters()
        m_jit, s_jit, e_jit = run_ep(jit, X, y, Xt, yt, args.max_iter)
        after = jit.counters()
        q = CountingOperator(quad)
        m_quad, s_quad, e_quad = run_ep(q, X, y, Xt, yt, args.max_iter)
        row = {
            "problem": name, "index": k, "n_train": len(y),
            "jit_seconds": s_jit, "jit_requests": after["requests"] - before["requests"],
            "jit_consultations": after["consultations"] - before["consultations"],
            "jit_test_error": e_jit,
            "quad_seconds": s_quad, "quad_requests": q.requests, "quad_test_error": e_quad,
            "operator_errors": {"jit": operator_errors(m_jit), "quad": operator_errors(m_quad)},
        }
        if k in is_problems:
            c = CountingOperator(is_oracle)
            m_is, s_is, e_is = run_ep(c, X, y, Xt, yt, args.max_iter)
            row.update({"is_seconds": s_is, "is_requests": c.requests, "is_test_error": e_is, "is_measured": True})
            row["operator_errors"]["is"] = operator_errors(m_is)
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
        vals = [r[key] for r in rs]
        return None if any(v is None for v in vals) else float(sum(vals))

    def ratio(a, b):  # None when sampling alone was not measured on any problem (--is-problems "")
        return None if a is None or b is None else a / b

    later = rows[first:]
    c = jit.counters()
    out = {
        "is_us_per_msg": None if per_msg is None else 1e6 * per_msg,
        "is_problems_measured": [r["problem"] for r in rows if r["is_measured"]],
        "speedup_vs_sampling": ratio(total("is_seconds", rows), total("jit_seconds", rows)),
        "speedup_vs_sampling_after_first": ratio(total("is_seconds", later), total("jit_seconds", later)),
        "jit_over_quad_after_first": total("jit_seconds", later) / total("quad_seconds", later),
        "threshold_used": jit.threshold,
        **({"density_guard_used": jit.density_guard} if jit.guard_share is not None else {}),
        **({"input_margin": jit.input_margin} if jit.input_margin is not None else {}),
        "consultation_rate": c["consultation_rate"],
        "consultation_rate_after_first": total("jit_consultations", later) / max(1.0, total("jit_requests", later)),
        "max_test_error_gap_vs_quad": float(max(abs(r["jit_test_error"] - r["quad_test_error"]) for r in rows)),
        "mean_test_error_gap_vs_quad": float(np.mean([r["jit_test_error"] - r["quad_test_error"] for r in rows])),
        "jit_seconds": total("jit_seconds", rows), "is_seconds": total("is_seconds", rows),
        "quad_seconds": total("quad_seconds", rows),
        "operator_errors": int(sum(sum(r["operator_errors"].values()) for r in rows)),
        "jit_counters": c,
    }
    return out
