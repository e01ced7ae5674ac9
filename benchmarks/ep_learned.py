"""EP with a served learned operator vs quadrature-EP: convergence, skipped updates, uncertainty (issue 19).

Protocol.  One real ``kjit serve`` in a subprocess (its default operators, trained from the
quadrature oracle on first start and cached in ``--store``; a bearer token so ``jit`` requests
are allowed).  Data sets in this order, through the *same* server (its JIT operator learns along
the sequence): scikit-learn's bundled breast-cancer data (a set no part of kjit was tuned on;
standardised on the training part, bias added, 200 training points, stratified split, seeds
``--seeds``), then the four paper UCI sets (banknote, blood transfusion, fertility, ionosphere;
``kjit.datasets.paper_split``, seed 0).  Bayesian logistic regression, prior N(0, I), labels as
Beta(2,1)/Beta(1,2), parallel EP schedule, ``tol`` 1e-6, at most ``--max-iter`` iterations, for
three operators:

* ``quadrature``: ``QuadratureOracle(Logistic())`` in process (the reference);
* ``jit``: ``RemoteOperator(url, "logistic-x", mode="jit")`` — the server consults its
  quadrature oracle where the operator is uncertain (belief variance above the threshold, or a
  message whose precision has an undetermined sign) and learns;
* ``predict``: ``RemoteOperator(url2, "logistic-x", mode="predict")`` on a second server started
  from the same pristine operators (predict mode never learns, so it stays as trained) — learned
  answers only, ``on_uncertain="warn"``: answers above the operator's threshold are used and
  counted (``uncertain_used``), never silently;
* ``predict_oracle``: the same with ``on_uncertain="oracle"``: those answers are replaced by the
  server's oracle (``mode=oracle`` requests, ``oracle_replaced``).

Per (data set, seed, operator), one JSON line: iterations, converged, outcome, skipped updates by
reason, messages used with precision 0 (``n_zeroed``), uncertain answers used, server
consultations, wall seconds, test error, and the max posterior gap to quadrature-EP in posterior
standard deviations (max over weights of |μ − μ_quad| / sd_quad).  Last line, the summary:
``max_iteration_ratio`` (jit / quadrature), ``all_converged`` (jit and predict),
``max_test_error_gap`` (jit and predict vs quadrature), ``max_wall_ratio_after_first`` (jit wall /
quadrature wall, over every run after the first data set), ``nonfinite_posteriors``,
``max_posterior_gap_sd`` (jit), ``jit_consultations``, and per predict variant its convergence,
iteration ratio, test-error gap, posterior gap, uncertain answers used and replaced.  Wall times are measured in one
run, so ratios are comparable; absolute seconds depend on the machine's load.

    python benchmarks/ep_learned.py [--quick] [--store DIR] [--seeds 0 1 2]

``--quick``: breast cancer seed 0 and banknote only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _blas import pin_blas_from_argv  # noqa: E402

BLAS_ENV_SET = pin_blas_from_argv()  # (before numpy loads BLAS)

import numpy as np  # noqa: E402

# the repository root before benchmarks/ (whose service.py would shadow the service package)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kjit.client import RemoteOperator
from kjit.datasets import Dataset, paper_split, train_test_split
from kjit.ep import BayesianLogisticRegression
from kjit.ep.engine import UncertainAnswerWarning
from kjit.factors import Logistic
from kjit.oracles import QuadratureOracle  # noqa: E402


UCI = ("banknote", "blood_transfusion", "fertility", "ionosphere")
TOKEN = "ep-learned-bench"


def breast_cancer(seed: int):
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    ds = Dataset("breast_cancer", np.asarray(d.data, float), np.asarray(d.target, np.int64),
                 tuple(str(f) for f in d.feature_names))
    return train_test_split(ds, 200, random_state=seed, standardize=True, add_bias=True)


def problems(args):
    out = [(f"breast_cancer", s, lambda s=s: breast_cancer(s)) for s in args.seeds]
    for name in args.uci:
        out.append((name, 0, lambda name=name: paper_split(name, random_state=0, add_bias=True)))
    return out


def run_ep(operator, split, args, on_uncertain="warn"):
    model = BayesianLogisticRegression(operator, max_iter=args.max_iter, tol=args.tol, schedule="parallel", damping=0.0,
                                       on_uncertain=on_uncertain)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncertainAnswerWarning)  # counted in n_uncertain
        model.fit(split.X_train, split.y_train)
    seconds = time.perf_counter() - t0
    res = model.result_
    finite = bool(np.all(np.isfinite(res.mean)) and np.all(np.isfinite(res.cov)))
    err = float(model.test_error(split.X_test, split.y_test)) if finite else None
    return model, {
        "iterations": res.iterations, "converged": res.converged, "outcome": res.outcome,
        "skipped": res.skipped, "n_zeroed": int(sum(r.n_zeroed for r in res.history)),
        "uncertain_used": res.n_uncertain, "oracle_replaced": int(sum(r.n_oracle for r in res.history)),
        "seconds": seconds, "test_error": err, "finite": finite,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--store", type=Path, default=None,
                    help="cache of the server's trained default operators (default: trained afresh in a temporary "
                         "directory); each run serves a copy, so every run starts from the same operators")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--uci", nargs="*", default=list(UCI))
    ap.add_argument("--max-iter", type=int, default=100)
    ap.add_argument("--tol", type=float, default=1e-6)
    ap.add_argument("--blas-threads", type=int, default=1,
                    help="BLAS threads for this process and the server (default 1; 0: the library's default)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.uci = [0], ["banknote"]

    from service.testing import SubprocessServer

    # one BLAS thread on both sides: the client runs the quadrature-EP reference and the EP engines,
    # whose wall times the ratios compare (found by an audit: only the server was limited)
    env = {"KJIT_TOKEN": TOKEN, **BLAS_ENV_SET}  # (applied to this process at import)
    tmp = tempfile.TemporaryDirectory(prefix="kjit-ep-learned-")
    cache = args.store if args.store is not None else Path(tmp.name) / "pristine"
    if not (cache / "operators" / "logistic-x" / "snapshot-00000000.npz").exists():
        # first start trains the default operators; killed (no final snapshot) so the cache
        # holds them as trained, and every run starts from a copy of that
        SubprocessServer(cache, env=env, train_defaults=True).start(timeout=1800).kill()
    servers = []
    for label in ("jit", "predict"):  # the predict-only server never learns: a pristine copy of its own
        store = Path(tmp.name) / f"store-{label}"
        shutil.copytree(cache, store)
        (store / ".lock").unlink(missing_ok=True)
        servers.append(SubprocessServer(store, env=env, train_defaults=True).start(timeout=1800))
    rows = []
    try:
        jit = RemoteOperator(servers[0].url, "logistic-x", token=TOKEN, mode="jit")
        # the token: its oracle view (mode=oracle) needs it (issue 21); predict requests do not
        pred = RemoteOperator(servers[1].url, "logistic-x", token=TOKEN, mode="predict")
        operators = (("jit", jit, "warn"), ("predict", pred, "warn"), ("predict_oracle", pred, "oracle"))
        quad_op = QuadratureOracle(Logistic())
        for k, (name, seed, make) in enumerate(problems(args)):
            split = make()
            quad, rq = run_ep(quad_op, split, args)
            mu_q, sd_q = quad.posterior_.mean, np.sqrt(np.diag(quad.posterior_.cov))
            out = {"quadrature": rq}
            for label, op, policy in operators:
                c0 = op.counters()["consultations"]
                model, r = run_ep(op, split, args, on_uncertain=policy)
                r["consultations"] = int(op.counters()["consultations"] - c0)
                if r["finite"]:
                    r["max_posterior_gap_sd"] = float(np.max(np.abs(model.posterior_.mean - mu_q) / sd_q))
                    r["max_var_ratio_err"] = float(np.max(np.abs(np.diag(model.posterior_.cov) / sd_q**2 - 1)))
                else:
                    r["max_posterior_gap_sd"] = r["max_var_ratio_err"] = None
                r["wall_ratio"] = r["seconds"] / rq["seconds"]
                r["iteration_ratio"] = r["iterations"] / rq["iterations"]
                out[label] = r
            row = {"dataset": name, "seed": seed, "order": k, **out}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for server in servers:
            server.stop()
        tmp.cleanup()

    def gap(r, m):
        x = r[m]
        return abs(x["test_error"] - r["quadrature"]["test_error"]) if x["test_error"] is not None else float("inf")

    labels = [lab for lab, _, _ in operators]
    summary = {
        "summary": True,
        "max_iteration_ratio": max(r["jit"]["iteration_ratio"] for r in rows),
        "all_converged": all(r["jit"]["converged"] for r in rows),
        "max_test_error_gap": max(gap(r, "jit") for r in rows),
        "max_wall_ratio_after_first": max((r["jit"]["wall_ratio"] for r in rows if r["order"] > 0), default=None),
        "nonfinite_posteriors": sum(not r[m]["finite"] for r in rows for m in labels + ["quadrature"]),
        "max_posterior_gap_sd": max(r["jit"]["max_posterior_gap_sd"] or float("inf") for r in rows),
        "skipped_negative_jit": sum(r["jit"]["skipped"]["negative"] for r in rows),
        "jit_consultations": sum(r["jit"]["consultations"] for r in rows),
        "runs": len(rows),
    }
    for m in ("predict", "predict_oracle"):  # the predict-only operator, its answers used / replaced when uncertain
        summary.update({
            f"{m}_all_converged": all(r[m]["converged"] for r in rows),
            f"{m}_max_iteration_ratio": max(r[m]["iteration_ratio"] for r in rows),
            f"{m}_max_test_error_gap": max(gap(r, m) for r in rows),
            f"{m}_max_posterior_gap_sd": max(r[m]["max_posterior_gap_sd"] or float("inf") for r in rows),
            f"{m}_uncertain_used": sum(r[m]["uncertain_used"] for r in rows),
            f"{m}_oracle_replaced": sum(r[m]["oracle_replaced"] for r in rows),
        })
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
