#!/usr/bin/env python
"""EP error bars from learned operators' draws (kjit.ep.error_bars): are they the size of the error?

Protocol.  Two models, EP with a learned operator against EP with the factor's exact rule (quadrature)
as the truth; the error bars come from ``--draws`` joint draws of the operator from its regression's
posterior (``graph_error_bars`` / ``linear_error_bars``, ``random_state`` = the seed).

* ``exp_counts``: a variable x ~ N(0, 4) and N Poisson counts k_i (drawn once per N, seed 100 + N, mean 5),
  each through the ``exp`` factor (rate eˣ, the count's message Gamma(k_i + 1, 1) on the rate) — N messages to
  one variable from one operator, the case where per-message errors add up.  The operator (x direction,
  D 200/400) is fitted on 2 500 pairs whose beliefs come from the per-message importance sampler
  (``MessageImportanceSampler``, as for a factor that can only be sampled), incoming messages x ~ N(U(−3, 3),
  logU(0.01, 4)), rate ~ Gamma(logU(1, 30), 1); one operator per seed (``--seeds``; training set, sampler and
  random features all seeded by it).  GraphEP, sequential schedule, damping 0, then 0.5, then 0.8 until a run
  converges (≤ 300 iterations); a (seed, N) whose learned EP converges at none is reported as such.
* ``exp_counts_jit``: the same counts through the user's path — a JITOperator of the operator of each of
  ``--jit-seeds`` (default 0; threshold calibrated to a per-message KL of 1e-3 on 600 held-out sampler pairs drawn
  with seed + 1, the per-message sampler as its oracle) in
  ``GraphEP(..., error_bars=--draws)``: the gap of its posterior, its bars, and whether it warned
  (``PosteriorErrorWarning``, default ``error_tol`` 0.1 sd).
* ``logistic_uci``: Bayesian logistic regression (LinearEP, prior N(0, I), parallel, damping 0.3) on the
  paper's UCI splits (``--datasets``, seed 0) with a logistic → x operator (D 300/500) fitted on 2 000
  quadrature pairs from the factor's default incoming distribution — a near-exact operator: are its bars
  small and its posterior within them?

Per row: the gap between the learned-operator posterior (the reference of the bars: EP with the operator's
posterior mean from the run's fixed point) and the exact-rule posterior, on the mean in the reference's posterior
sds, the bars' unit (``gap_mean_sd``) and on the log variance (``gap_log_var``); the bars (``bar_mean_sd``, ``bar_log_var``); their
ratios ``z_mean``, ``z_log_var`` (for logistic_uci the gaps and bars are the largest over the weights, the z's
the root mean square over the weights of each weight's ratio, ``*_max`` the largest); draws that made EP fail
(``n_failed``); the seconds of the run and of the bars.  Summary: the root mean square of the z's (1 if the
bars are the errors' standard deviation), the share of |z| ≤ 2, the runs that did not converge, and the bars
that are infinite (more than 31.7 % of the draws made EP fail: printed as null, with a null z).  Prints
one JSON object per line.  ``--quick``: seeds 0–1, N = 6 and 20, banknote only.

    python benchmarks/error_bars.py [--quick] [--seeds 0 1 2 3] [--draws 16] [--jit-seeds 0 1 2] [--models ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _blas import pin_blas_from_argv  # noqa: E402

pin_blas_from_argv()  # (before numpy loads BLAS)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kjit.datasets import paper_split  # noqa: E402
from kjit.ep import LinearEP, graph_error_bars, linear_error_bars  # noqa: E402
from kjit.ep.graph import FactorGraph, GraphEP  # noqa: E402
from kjit.factors import get_factor, logistic_incoming  # noqa: E402
from kjit.families import Beta, Gamma, Gaussian  # noqa: E402
from kjit.operators import KernelOperator  # noqa: E402
from kjit.oracles import MessageImportanceSampler, QuadratureOracle  # noqa: E402
from kjit.training import make_training_set  # noqa: E402


def _exp_inputs(n, rng):
    return {"x": Gaussian(rng.uniform(-3, 3, n), np.exp(rng.uniform(np.log(0.01), np.log(4), n))),
            "y": Gamma(np.exp(rng.uniform(0, np.log(30), n)), np.ones(n))}


def _exp_operator(f, seed):
    """The x operator of seed ``seed``: 2 500 per-message-sampler pairs, D 200/400, all seeded by it."""
    ts = make_training_set(f, "x", _exp_inputs, MessageImportanceSampler(f, random_state=seed), n=2500,
                           random_state=seed)
    return KernelOperator(f, "x", n_inner=200, n_outer=400, random_state=seed).fit(ts)


def _counts_graph(factor, n):
    k = np.random.default_rng(100 + n).poisson(5.0, n)
    g = FactorGraph()
    g.add_variable("x", Gaussian(0.0, 4.0))
    for kk in k:
        g.add_factor(factor, {"x": "x", "y": Gamma(float(kk) + 1.0, 1.0)})
    return g


def _z(gap, bar):
    """gap / bar; None where the bar is infinite (too many draws made EP fail) or 0 with a gap."""
    if not np.isfinite(bar) or (bar == 0 and gap != 0):
        return None
    return 0.0 if bar == 0 else float(gap / bar)


def _r(x, digits):
    """A figure for JSON: rounded; None for an infinite bar (JSON has no infinity)."""
    return round(float(x), digits) if np.isfinite(x) else None


def exp_counts(seeds, counts, draws):
    f = get_factor("exp")
    rows = []
    for seed in seeds:
        op = _exp_operator(f, seed)
        for n in counts:
            g = _counts_graph(f, n)
            exact = GraphEP(g, schedule="sequential", max_iter=500).run()
            row = {"bench": "error_bars", "model": "exp_counts", "seed": seed, "n_counts": n}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for damping in (0.0, 0.5, 0.8):
                    ep = GraphEP(g, {("exp", "x"): op}, schedule="sequential", damping=damping, max_iter=300)
                    t = time.perf_counter()
                    res = ep.run()
                    run_s = time.perf_counter() - t
                    if res.converged:
                        break
                if not res.converged:
                    rows.append({**row, "converged": False})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                t = time.perf_counter()
                eb = graph_error_bars(ep, res, n_draws=draws, random_state=seed)
                bars_s = time.perf_counter() - t
            m, v = eb.reference["x"]
            em, ev = float(exact.beliefs["x"].mean()), float(exact.beliefs["x"].var())
            gap, lgap = (m - em) / np.sqrt(v), float(np.log(v / ev))
            zm, zl = _z(gap, eb.mean_sd["x"]), _z(lgap, eb.log_var_sd["x"])
            rows.append({**row, "converged": True, "damping": damping, "gap_mean_sd": _r(gap, 5),
                         "bar_mean_sd": _r(eb.mean_sd["x"], 5), "z_mean": None if zm is None else round(zm, 3),
                         "gap_log_var": _r(lgap, 5), "bar_log_var": _r(eb.log_var_sd["x"], 5),
                         "z_log_var": None if zl is None else round(zl, 3), "n_failed": eb.n_failed,
                         "iterations": res.iterations, "run_seconds": round(run_s, 3), "bars_seconds": round(bars_s, 3)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def exp_counts_jit(seeds, counts, draws):
    """The user's path: a JITOperator (the seed-0 operator, threshold calibrated to a per-message KL of 1e-3 on 600
    held-out sampler pairs, the per-message sampler as its oracle at a target standard error 0.01) in GraphEP with
    ``error_bars`` — one row per N: the gap, the bars, whether a PosteriorErrorWarning was raised."""
    import copy

    from kjit.ep import PosteriorErrorWarning
    from kjit.operators import JITOperator, calibrate_threshold

    f = get_factor("exp")
    rows = []
    for seed, n in [(s, n) for s in seeds for n in counts]:
        if n == counts[0]:  # (one operator per seed, as exp_counts': its held-out pairs from seed + 1)
            op = _exp_operator(f, seed)
            held = make_training_set(f, "x", _exp_inputs, MessageImportanceSampler(f, random_state=seed + 1), n=600,
                                     random_state=seed + 1)
            threshold = calibrate_threshold(op, held, 1e-3)
        g = _counts_graph(f, n)
        exact = GraphEP(g, schedule="sequential", max_iter=500).run()
        jit = JITOperator(copy.deepcopy(op), MessageImportanceSampler(f, random_state=7, target_se=1e-2),
                          threshold=threshold)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = time.perf_counter()
            res = GraphEP(g, {("exp", "x"): jit}, schedule="sequential", max_iter=300, error_bars=draws).run()
            seconds = time.perf_counter() - t
        row = {"bench": "error_bars", "model": "exp_counts_jit", "seed": seed, "n_counts": n,
               "converged": bool(res.converged),
               "threshold": round(float(threshold), 3), "consulted": int(jit.raw_counters()["consultations"])}
        if res.converged and res.error_bars is not None:
            m, v = float(res.beliefs["x"].mean()), float(res.beliefs["x"].var())
            em, ev = float(exact.beliefs["x"].mean()), float(exact.beliefs["x"].var())
            eb = res.error_bars
            row.update({"gap_mean_sd": _r((m - em) / np.sqrt(v), 5), "bar_mean_sd": _r(eb.mean_sd["x"], 5),
                        "gap_log_var": _r(np.log(v / ev), 5), "bar_log_var": _r(eb.log_var_sd["x"], 5),
                        "n_failed": eb.n_failed,
                        "warned": any(issubclass(w.category, PosteriorErrorWarning) for w in caught),
                        "seconds_with_bars": round(seconds, 3)})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def logistic_uci(datasets, draws):
    f = get_factor("logistic")
    ts = make_training_set(f, "x", logistic_incoming, QuadratureOracle(f), n=2000, random_state=0)
    op = KernelOperator(f, "x", n_inner=300, n_outer=500, random_state=0).fit(ts)
    rows = []
    for name in datasets:
        sp = paper_split(name, 0)
        y = np.asarray(sp.y_train) > 0
        observed = {"z": Beta(np.where(y, 2.0, 1.0), np.where(y, 1.0, 2.0))}
        A = np.asarray(sp.X_train, float)
        exact = LinearEP(QuadratureOracle(f), damping=0.3).run(A, observed)
        ep = LinearEP(op, damping=0.3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = time.perf_counter()
            res = ep.run(A, observed)
            run_s = time.perf_counter() - t
            row = {"bench": "error_bars", "model": "logistic_uci", "dataset": name, "d": A.shape[1]}
            if not res.converged:
                rows.append({**row, "converged": False})
                print(json.dumps(rows[-1]), flush=True)
                continue
            t = time.perf_counter()
            eb = linear_error_bars(ep, A, observed, res, n_draws=draws, random_state=0)
            bars_s = time.perf_counter() - t
        ref = np.array([eb.reference[f"w[{i}]"] for i in range(A.shape[1])])
        gaps = (ref[:, 0] - exact.mean) / np.sqrt(ref[:, 1])
        lgaps = np.log(ref[:, 1] / np.diag(exact.cov))
        bm = np.array([eb.mean_sd[f"w[{i}]"] for i in range(A.shape[1])])
        bl = np.array([eb.log_var_sd[f"w[{i}]"] for i in range(A.shape[1])])
        zm = np.array([np.inf if _z(a, b) is None else _z(a, b) for a, b in zip(gaps, bm)])
        zl = np.array([np.inf if _z(a, b) is None else _z(a, b) for a, b in zip(lgaps, bl)])
        rows.append({**row, "converged": True, "gap_mean_sd": _r(np.max(np.abs(gaps)), 7),
                     "bar_mean_sd": _r(np.max(bm), 7), "z_mean": _r(np.sqrt(np.mean(zm**2)), 3),
                     "z_mean_max": _r(np.max(np.abs(zm)), 3),
                     "gap_log_var": _r(np.max(np.abs(lgaps)), 7), "bar_log_var": _r(np.max(bl), 7),
                     "z_log_var": _r(np.sqrt(np.mean(zl**2)), 3), "z_log_var_max": _r(np.max(np.abs(zl)), 3),
                     "n_failed": eb.n_failed,
                     "iterations": res.iterations, "run_seconds": round(run_s, 3), "bars_seconds": round(bars_s, 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seeds 0-1, N = 6 and 20, banknote only")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="operators of exp_counts (default 0-7)")
    ap.add_argument("--counts", type=int, nargs="+", default=None, help="N of exp_counts (default 6 20 60)")
    ap.add_argument("--datasets", nargs="+", default=None, help="logistic_uci's sets (default the paper's four)")
    ap.add_argument("--draws", type=int, default=16)
    ap.add_argument("--jit-seeds", type=int, nargs="+", default=[0], help="operators of exp_counts_jit (default 0)")
    ap.add_argument("--models", nargs="+", default=["exp_counts", "exp_counts_jit", "logistic_uci"],
                    choices=["exp_counts", "exp_counts_jit", "logistic_uci"], help="which models to run (default all)")
    ap.add_argument("--blas-threads", type=int, default=1, help="BLAS threads (read before numpy loads)")
    a = ap.parse_args(argv)
    seeds = a.seeds or ([0, 1] if a.quick else list(range(8)))
    counts = a.counts or ([6, 20] if a.quick else [6, 20, 60])
    datasets = a.datasets or (["banknote"] if a.quick else ["banknote", "blood_transfusion", "fertility", "ionosphere"])
    models = set(a.models)
    rows = ((exp_counts(seeds, counts, a.draws) if "exp_counts" in models else [])
            + (exp_counts_jit(a.jit_seeds, counts, a.draws) if "exp_counts_jit" in models else [])
            + (logistic_uci(datasets, a.draws) if "logistic_uci" in models else []))
    done = [r for r in rows if r["converged"]]
    summary = {"bench": "error_bars_summary", "draws": a.draws, "n_rows": len(rows),
               "n_not_converged": len(rows) - len(done)}
    summary["n_infinite_bars"] = sum(1 for r in done if r.get("z_mean", 0) is None)
    summary["jit_warned"] = {f'{r["seed"]}/{r["n_counts"]}': r.get("warned") for r in rows
                             if r["model"] == "exp_counts_jit"}
    for model in ("exp_counts", "logistic_uci"):
        zs = [r for r in done if r["model"] == model]
        for key in ("z_mean", "z_log_var"):
            z = np.array([r[key] for r in zs if r[key] is not None], float)  # (infinite bars apart: counted above)
            summary[f"{model}_rms_{key}"] = round(float(np.sqrt(np.mean(z**2))), 3) if z.size else None
            summary[f"{model}_within2_{key}"] = round(float(np.mean(np.abs(z) <= 2)), 3) if z.size else None
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
