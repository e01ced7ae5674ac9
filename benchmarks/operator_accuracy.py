#!/usr/bin/env python
"""Accuracy and cost of the learned operator: the KJIT paper's batch protocol.

Protocol
--------
* Logistic factor: incoming messages are recorded from the first 5 iterations of
  quadrature-EP (parallel schedule) on ``--problems`` synthetic logistic-regression problems
  (d = 20, n = 300; w, a ~ N(0, I)).  Training pairs come from the first 60 % of the problems
  and test pairs from the rest, so no test message comes from a problem seen in training
  (stricter than a random split of the pooled messages); ``--n-train`` / ``--n-test`` pairs are
  drawn from each pool.  Direction x uses the beliefs EP asked for; direction z asks the
  quadrature oracle for the belief on z at the same incoming messages.
* Compound gamma (message to τ): problems with n ~ U{10..100} observations x_j ~ N(0, 1/τ),
  τ drawn from the compound-gamma prior; the incoming message is the conjugate
  Gamma(1 + n/2, Σx²/2); beliefs by quadrature.
* Accuracy: KL[q ‖ q̂] between the quadrature belief and the operator's, on test pairs;
  ``mean_log_kl`` / ``sd_log_kl`` of its natural log (paper: −8.97 ± 1.57 for logistic→x).
* Cost: ``predict_us_per_msg`` — one batched call on the ``--n-test`` test messages that
  returns beliefs and log predictive variances (best of 5); ``blas_floor_us_per_msg`` — the
  bare matrix products at the same shapes and dtype (batch×D_in by D_in×D_out, and the
  batch×D_out by D_out×D_out variance form; best of 5); ``quad_us_per_msg`` and
  ``is_us_per_msg`` (5×10^5 particles, on ``--n-is`` messages) on the same inputs.
* Curves: accuracy and cost for D_out in ``--dout-curve`` (D_in = D_out / 2); prediction
  cost at training-set sizes ``--sizes`` (it must not grow with N: the primal form).
* U-shape: log predictive variance of Gaussian test messages whose mean sweeps far outside
  the training range (plot in ``--out``).

One JSON object per line; the last is a summary of the logistic→x figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from kjit.datasets import synthetic_logistic
from kjit.ep.models import BayesianLogisticRegression
from kjit.ep.recording import RecordingOperator
from kjit.factors import CompoundGamma, Logistic
from kjit.families import Beta, Gamma, Gaussian
from kjit.operators import KernelOperator
from kjit.oracles import ImportanceSamplingOracle, QuadratureOracle
from kjit.training import TrainingSet


def emit(obj):
    print(json.dumps(obj), flush=True)


def best_of(fn, repeat=5):
    best, out = np.inf, None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def record_logistic(n_problems, d, n, iters, seed):
    """Incoming messages (and x-beliefs) of quadrature-EP, per problem."""
    quad = QuadratureOracle(Logistic())
    per_problem = []
    for p in range(n_problems):
        rec = RecordingOperator(quad)
        X, y, _ = synthetic_logistic(d=d, n=n, random_state=seed + p)
        BayesianLogisticRegression(rec, max_iter=iters, compute_evidence=False, warn_unconverged=False,
                                   damping=0.0).fit(X, y)
        per_problem.append(TrainingSet("logistic", "x", rec.incoming("x"), rec.beliefs("x")))
    return per_problem


def pools(sets, frac=0.6):
    k = max(1, int(round(frac * len(sets))))
    return TrainingSet.concatenate(sets[:k]), TrainingSet.concatenate(sets[k:])


def draw(ts, m, rng):
    m = min(m, len(ts))
    return ts.subset(np.sort(rng.choice(len(ts), m, replace=False)))


def with_z_beliefs(ts):
    quad = QuadratureOracle(Logistic())
    return TrainingSet("logistic", "z", ts.incoming, quad.belief(ts.incoming, "z"))


def compound_gamma_pairs(m, rng):
    cg = CompoundGamma()
    n_obs = rng.integers(10, 101, size=m)
    tau = cg.sample({}, m, rng)
    s = np.array([np.sum(rng.normal(0.0, 1.0 / np.sqrt(t), size=k) ** 2) for t, k in zip(tau, n_obs)])
    inc = {"tau": Gamma(1.0 + n_obs / 2.0, s / 2.0)}
    return TrainingSet("compound_gamma", "tau", inc, QuadratureOracle(cg).belief(inc, "tau"), cg.params())


def blas_floor(batch, d_in, d_out, dtype, rng):
    a = rng.standard_normal((batch, d_in)).astype(dtype)
    w = rng.standard_normal((d_in, d_out)).astype(dtype)
    psi = rng.standard_normal((batch, d_out)).astype(dtype)
    sig = rng.standard_normal((d_out, d_out)).astype(dtype)
    t, _ = best_of(lambda: (a @ w, psi @ sig))
    return t


def evaluate(op, test, label, args, rng, oracle_cost=True):
    t_fit = op.fit_seconds_
    q_hat, _ = op.predict(test.incoming)
    kl = test.beliefs.kl(q_hat)
    logkl = np.log(np.maximum(kl, 1e-300))
    n = len(test)
    t_pred, _ = best_of(lambda: op.predict(test.incoming))
    floor = blas_floor(n, op.n_inner, op.n_outer, op.dtype, rng)
    row = {
        **label, "n_train": op.n_train_, "n_test": n, "d_in": op.n_inner, "d_out": op.n_outer,
        "dtype": op.dtype.name, "treatment": op.treatment,
        "mean_log_kl": float(np.mean(logkl)), "sd_log_kl": float(np.std(logkl)),
        "median_log_kl": float(np.median(logkl)), "max_log_kl": float(np.max(logkl)),
        "predict_us_per_msg": 1e6 * t_pred / n, "blas_floor_us_per_msg": 1e6 * floor / n,
        "predict_over_floor": t_pred / floor, "fit_seconds": t_fit,
        "hyperparameters": op.hyperparameters(),
    }
    if oracle_cost:
        factor = op.factor
        quad = QuadratureOracle(factor)
        t_quad, _ = best_of(lambda: quad.belief(test.incoming, op.to), repeat=2)
        k = min(args.n_is, n)
        sub = {v: m[:k] for v, m in test.incoming.items()}
        iso = ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=0)
        t_is, _ = best_of(lambda: iso.belief(sub, op.to), repeat=1)
        row.update({
            "quad_us_per_msg": 1e6 * t_quad / n, "is_us_per_msg": 1e6 * t_is / k,
            "speedup_vs_is": (t_is / k) / (t_pred / n), "speedup_vs_quad": (t_quad / n) / (t_pred / n),
        })
    return row


def u_shape(op, train, args):
    """Log predictive variance as the mean of a Gaussian x-message leaves the training range.

    Messages N(m, v) with v the median training variance and a label message Beta(2, 1); m
    sweeps from 2 range-widths below the training means to 2 above.  "Inside" is the central
    90 % of the training means (where the training data are), "far" is more than one range
    width outside them.  The sweep is written as CSV (and PNG when matplotlib is installed).
    """
    xm = train.incoming["x"].mean()
    lo, hi = np.min(xm), np.max(xm)
    q05, q95 = np.quantile(xm, [0.05, 0.95])
    width = hi - lo
    means = np.linspace(lo - 2 * width, hi + 2 * width, 321)
    v = float(np.median(train.incoming["x"].var()))
    inc = {"x": Gaussian(means, v), "z": Beta(np.full_like(means, 2.0), 1.0)}
    logvar = np.max(op.uncertainty(inc), axis=-1)
    inside = (means >= q05) & (means <= q95)
    row = {"u_shape": True, "train_mean_range": [float(lo), float(hi)], "central_90": [float(q05), float(q95)],
           "median_logvar_inside": float(np.median(logvar[inside])),
           "max_logvar_inside": float(np.max(logvar[inside])),
           "min_logvar_far_left": float(np.min(logvar[means < lo - width])),
           "min_logvar_far_right": float(np.min(logvar[means > hi + width]))}
    csv = os.path.join(args.out, "u_shape.csv")
    np.savetxt(csv, np.column_stack([means, logvar]), delimiter=",", header="mean,max_log_predictive_variance",
               comments="")
    row["csv"] = csv
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(means, logvar)
        ax.axvspan(q05, q95, alpha=0.15, label="central 90% of training means")
        ax.set_xlabel("mean of incoming x-message")
        ax.set_ylabel("log predictive variance")
        ax.set_title("Uncertainty outside the training range (logistic → x)")
        ax.legend()
        fig.tight_layout()
        path = os.path.join(args.out, "u_shape.png")
        fig.savefig(path, dpi=110)
        row["plot"] = path
    except ImportError:
        row["plot"] = None  # matplotlib comes with the `notebook` extra
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small version, under a minute")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--n-train", type=int, default=5000)
    ap.add_argument("--n-test", type=int, default=3000)
    ap.add_argument("--d-in", type=int, default=500)
    ap.add_argument("--d-out", type=int, default=1000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="prediction dtype of the main rows (both are reported for logistic→x)")
    ap.add_argument("--treatment", default="unconstrained",
                    choices=["gaussian", "exact", "unconstrained", "both", "all"],
                    help="inner-embedding treatment of non-Gaussian messages; 'both' = gaussian and exact, "
                         "'all' = the three (the first listed gives the summary)")
    ap.add_argument("--dout-curve", default="250,500,1000,2000")
    ap.add_argument("--sizes", default="1000,10000,50000", help="training-set sizes for the cost-vs-N rows")
    ap.add_argument("--particles", type=int, default=500_000)
    ap.add_argument("--n-is", type=int, default=50)
    ap.add_argument("--directions", default="x,z,tau")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    args = ap.parse_args(argv)
    if args.quick:
        args.problems, args.n_train, args.n_test = 6, 1000, 500
        args.d_in, args.d_out = 100, 200
        args.dout_curve, args.sizes = "100,200", "500,2000"
        args.particles, args.n_is = 100_000, 10
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    directions = args.directions.split(",")
    treatments = {"both": ["gaussian", "exact"], "all": ["unconstrained", "gaussian", "exact"]}.get(
        args.treatment, [args.treatment])

    t = time.perf_counter()
    sets = record_logistic(args.problems, 20, 300, 5, args.seed)
    pool_tr, pool_te = pools(sets)
    emit({"recorded": "logistic", "problems": args.problems, "messages": len(pool_tr) + len(pool_te),
          "train_pool": len(pool_tr), "test_pool": len(pool_te), "seconds": time.perf_counter() - t})
    train_x, test_x = draw(pool_tr, args.n_train, rng), draw(pool_te, args.n_test, rng)

    def fit(factor, to, train, d_in, d_out, dtype, treatment):
        return KernelOperator(factor, to, n_inner=d_in, n_outer=d_out, treatment=treatment,
                              random_state=args.seed, dtype=dtype).fit(train)

    summary = {"benchmark": "operator_accuracy", "split": "problem-disjoint"}
    if "x" in directions:
        for treatment in treatments:
            op = fit("logistic", "x", train_x, args.d_in, args.d_out, args.dtype, treatment)
            row = evaluate(op, test_x, {"factor": "logistic", "direction": "x"}, args, rng)
            emit(row)
            if treatment == treatments[0]:
                summary.update({k: row[k] for k in ("mean_log_kl", "sd_log_kl", "predict_us_per_msg",
                                                    "blas_floor_us_per_msg", "is_us_per_msg", "quad_us_per_msg",
                                                    "speedup_vs_is", "dtype")})
                other = "float64" if args.dtype == "float32" else "float32"
                op2 = fit("logistic", "x", train_x, args.d_in, args.d_out, other, treatment)
                emit(evaluate(op2, test_x, {"factor": "logistic", "direction": "x"}, args, rng, oracle_cost=False))
                emit(u_shape(op, train_x, args))
        for d_out in [int(v) for v in args.dout_curve.split(",")]:
            op = fit("logistic", "x", train_x, max(d_out // 2, 1), d_out, args.dtype, treatments[0])
            r = evaluate(op, test_x, {"curve": "d_out", "factor": "logistic", "direction": "x"}, args, rng,
                         oracle_cost=False)
            emit({k: r[k] for k in ("curve", "d_in", "d_out", "mean_log_kl", "sd_log_kl", "predict_us_per_msg",
                                    "blas_floor_us_per_msg", "fit_seconds")})
        # prediction cost vs training-set size: same feature sizes, N pairs (repeated draws if the pool is small)
        for size in [int(v) for v in args.sizes.split(",")]:
            idx = rng.choice(len(pool_tr), size, replace=size > len(pool_tr))
            op = KernelOperator("logistic", "x", n_inner=args.d_in, n_outer=args.d_out, random_state=args.seed,
                                dtype=args.dtype, inner_factors=[op.inner_factor_], width_factors=[op.width_factor_],
                                prior_vars=[op.prior_var_], noise_vars=[op.noise_var_]).fit(pool_tr.subset(idx))
            t_pred, _ = best_of(lambda: op.predict(test_x.incoming))
            emit({"scaling": "n_train", "n_train": size, "predict_us_per_msg": 1e6 * t_pred / len(test_x),
                  "fit_seconds": op.fit_seconds_})
    if "z" in directions:
        train_z, test_z = with_z_beliefs(train_x), with_z_beliefs(test_x)
        for treatment in treatments:
            op = fit("logistic", "z", train_z, args.d_in, args.d_out, args.dtype, treatment)
            emit(evaluate(op, test_z, {"factor": "logistic", "direction": "z"}, args, rng))
    if "tau" in directions:
        train_t = compound_gamma_pairs(args.n_train, rng)
        test_t = compound_gamma_pairs(args.n_test, rng)
        for treatment in treatments:
            op = fit("compound_gamma", "tau", train_t, args.d_in, args.d_out, args.dtype, treatment)
            emit(evaluate(op, test_t, {"factor": "compound_gamma", "direction": "tau"}, args, rng))
    emit(summary)


if __name__ == "__main__":
    sys.exit(main())
