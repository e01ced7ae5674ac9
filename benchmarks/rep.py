"""EP, power EP and relaxed EP on the relaxed-EP paper's experiments (issue 8); JSON lines.

Sections (``--sections``, default all):

``five_point``  §7.1: five 2-D points, one mislabelled, ε = 0.2, linear kernel (so the model is
                the weight-space ProbitClassifier with w ~ N(0, I)).  Error of the posterior mean
                and covariance of EP, PEP (u = 0.8) and REP (c = 20) — and sweeps over u and c
                (the paper's Fig. 2 b–e) — against an importance-sampling posterior (prior as the
                proposal, ``--is-samples`` ≥ 10⁷, chunked and vectorised) and against the exact
                posterior (in 2-D the likelihood is constant on angular sectors, so the posterior
                moments are sums of closed-form sector integrals).  The paper gives the points
                only as a figure: ours are listed in the output.  Errors are mean squared
                differences over the 2 mean entries / 4 covariance entries (the paper's "mean
                square distances").
``synthetic``   §7.2: 200 points per class (class 1 one Gaussian, class 2 a mixture of two),
                10 % and 20 % of training labels flipped, ε = flip rate, RBF kernel, test on
                clean labels; ``--repeats`` data sets per noise level.  Kernel width chosen per
                data set by the EP evidence (parallel EP, damping 0.5, which converges) on a grid,
                then EP, PEP (u = 0.8) and REP (c = ``--rep-c``; plus REP at the paper's c = 10)
                are run undamped with the paper's sequential schedule until
                R = ‖α_t − α_{t−1}‖ < 1e-3 or ``--max-iter`` (a *divergence*).
``uci``         §7.3: heart, pima, haberman with the paper's split sizes (kjit.datasets), and spam
                with extra label noise (flipped in training and test labels, as in the paper),
                features standardised; width and ε chosen by the EP evidence as above.
``laplace``     Laplace propagation vs EP on Bayesian logistic regression (heart, pima): test
                error, time, and the distance between the two posteriors.

Issue 18 (the paper's readings, ``kjit.ep.engine.RELAX_READINGS``; ``--readings``): every
section also runs EP with damping ``--damping`` (``ep_damped``, the baseline the paper omits) and
each reading over ``--reading-c`` (or per reading ``--reading-grid READING=c1,c2``); the
five-point section sweeps each reading over c ∈ [1e-3, 100] (``readings``), scans the position of
the mislabelled point for EP (``ep_outlier_scan``) and repeats the sweeps on EP's worst placement
(``alt``, against the exact posterior).  Findings: ``benchmarks/README.md``.

The last line is a summary with ``ep_test_error``, ``pep_test_error``, ``rep_test_error``,
``ep_divergences``, ``pep_divergences``, ``rep_divergences`` (synthetic problems), and
``rep_readings``: per reading its ``test_error`` and ``divergences`` (synthetic, at the c of its
grid with the fewest divergences and then the lowest test error — chosen on the test sets, the
choice most favourable to REP — with ``by_c``, ``relaxed_updates`` and the differences to EP),
``five_point_mean_mse`` / ``five_point_cov_mse`` (against the IS posterior at the paper's c = 20),
``five_point_best`` / ``five_point_alt_best`` (the best c of the sweeps), ``uci_test_error``; then
``baselines`` (EP, damped EP, PEP) and ``best_reading`` with ``best_reading_relaxes`` (False: its
best c never relaxed, i.e. it is EP) and ``best_reading_beats_ep``.  ``--combine FILE ...``
prints that summary for runs split across processes (``--first-repeat``).

    python benchmarks/rep.py --quick            # ~10 CPU-minutes: 1 data set per noise level,
                                                # 4000 test points, ≤ 40 iterations, 10⁷ IS samples,
                                                # UCI heart, haberman, spam (one split each)
    python benchmarks/rep.py                    # the paper's sizes: 10 repeats, 39,600 test points,
                                                # ≤ 100 iterations, 10⁸ IS samples (hours on 2 cores)
"""

from __future__ import annotations

import os

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # many small dense ops: threads only contend on a shared box

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kjit, not an installed one

from kjit.datasets import load, paper_split, train_test_split  # noqa: E402
from kjit.ep.engine import RELAX_READINGS  # noqa: E402
from kjit.ep import (  # noqa: E402
    BayesianLogisticRegression,
    GPClassifier,
    LaplaceOperator,
    LogisticOperator,
    ProbitClassifier,
    ProbitNoiseOperator,
)
from kjit.factors import Logistic  # noqa: E402


def emit(obj):
    print(json.dumps(obj, default=_json_default), flush=True)


def _json_default(o):
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(type(o))


# =========================================================================== five points
FIVE_X = np.array([[-1.0, 0.6], [-1.4, -0.4], [1.2, 0.6], [1.0, -0.7], [2.6, 0.3]])
FIVE_Y = np.array([1, 1, 0, 0, 1])  # the last point (on the right, among class 0) is mislabelled
# EP's worst placement of the mislabelled point in a scan (see ``ep_outlier_scan``): a second
# configuration where EP is further from exact, so an improvement would have room to show
FIVE_X_ALT = np.vstack([FIVE_X[:4], [[2.6, -1.5]]])
OUTLIER_SCAN = ([2.6, 0.3], [4.0, 0.3], [6.0, 0.3], [2.6, -1.5], [2.6, 1.5], [1.5, 2.0], [0.5, 2.0], [3.0, 3.0])
FIVE_C_SWEEP = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 20.0, 100.0)


def exact_posterior_2d(X, y01, eps):
    """Exact posterior mean/cov of w ~ N(0, I₂) under Π (ε + (1−2ε) Θ(y xᵀw)): the likelihood is
    constant on the angular sectors cut by the lines xᵢᵀw = 0, and N(0, I) restricted to a sector
    has closed-form moments (radial integrals √(π/2) and 2)."""
    ypm = np.where(y01 == 1, 1.0, -1.0)
    th = np.arctan2(X[:, 1], X[:, 0])
    b = np.sort(np.mod(np.concatenate([th + np.pi / 2, th - np.pi / 2]), 2 * np.pi))
    b = np.concatenate([b, [b[0] + 2 * np.pi]])
    Z, M, S = 0.0, np.zeros(2), np.zeros((2, 2))
    for a, c in zip(b[:-1], b[1:]):
        if c - a <= 0:
            continue
        mid = 0.5 * (a + c)
        L = np.prod(eps + (1 - 2 * eps) * (ypm * (X @ np.array([np.cos(mid), np.sin(mid)])) > 0))
        d, s2 = c - a, (np.sin(2 * c) - np.sin(2 * a)) / 4
        cs = (np.sin(c) ** 2 - np.sin(a) ** 2) / 2
        Z += L * d / (2 * np.pi)
        M += L * np.sqrt(np.pi / 2) / (2 * np.pi) * np.array([np.sin(c) - np.sin(a), np.cos(a) - np.cos(c)])
        S += L * 2 / (2 * np.pi) * np.array([[d / 2 + s2, cs], [cs, d / 2 - s2]])
    mean = M / Z
    return mean, S / Z - np.outer(mean, mean)


def is_posterior(X, y01, eps, n, seed, chunk=1_000_000):
    """Self-normalised importance sampling with the prior N(0, I) as proposal (weights = the
    likelihood, bounded by (1−ε)^n): chunked, vectorised."""
    rng = np.random.default_rng(seed)
    ypm = np.where(y01 == 1, 1.0, -1.0)
    d = X.shape[1]
    sw = sww = 0.0
    s1, s2 = np.zeros(d), np.zeros((d, d))
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        W = rng.standard_normal((k, d))
        w = np.prod(eps + (1 - 2 * eps) * ((W @ X.T) * ypm > 0), axis=1)
        sw += w.sum()
        sww += (w * w).sum()
        s1 += w @ W
        s2 += (W * w[:, None]).T @ W
    m = s1 / sw
    return m, s2 / sw - np.outer(m, m), sw * sw / sww


def five_point(args):
    eps = 0.2
    t0 = time.perf_counter()
    m_ex, C_ex = exact_posterior_2d(FIVE_X, FIVE_Y, eps)
    m_is, C_is, ess = is_posterior(FIVE_X, FIVE_Y, eps, args.is_samples, args.seed)
    is_seconds = time.perf_counter() - t0
    op = ProbitNoiseOperator(eps)

    def run(X=FIVE_X, ref=None, **kw):
        m = ProbitClassifier(op, tol=1e-12, max_iter=1000, schedule="sequential", warn_unconverged=False,
                             **kw).fit(X, FIVE_Y)  # (convergence is reported)
        if ref is not None:  # another configuration: errors against its exact posterior only
            return {"converged": m.converged_, "outcome": m.result_.outcome, "iterations": m.n_iter_,
                    "relaxed_updates": int(sum(r.n_relaxed for r in m.result_.history)),
                    "mean_mse_vs_exact": float(np.mean((m.coef_ - ref[0]) ** 2)),
                    "cov_mse_vs_exact": float(np.mean((m.posterior_.cov - ref[1]) ** 2)),
                    "boundary_angle_error_deg": float(np.degrees(np.abs(np.angle(complex(*m.coef_) / complex(*ref[0])))))}
        hist = m.result_.history
        return {
            "converged": m.converged_, "iterations": m.n_iter_, "outcome": m.result_.outcome,
            "relaxed_updates": int(sum(r.n_relaxed for r in hist)),
            "mean": m.coef_, "cov": m.posterior_.cov,
            "mean_mse_vs_is": float(np.mean((m.coef_ - m_is) ** 2)),
            "cov_mse_vs_is": float(np.mean((m.posterior_.cov - C_is) ** 2)),
            "mean_mse_vs_exact": float(np.mean((m.coef_ - m_ex) ** 2)),
            "cov_mse_vs_exact": float(np.mean((m.posterior_.cov - C_ex) ** 2)),
            "boundary_angle_error_deg": float(np.degrees(np.abs(np.angle(
                complex(*m.coef_) / complex(*m_ex))))),
            "sites_relaxed_last_iter": m.result_.history[-1].n_relaxed,
        }

    out = {
        "section": "five_point", "eps": eps, "X": FIVE_X, "y": FIVE_Y, "mislabelled_index": 4,
        "is_samples": args.is_samples, "is_ess": ess, "is_seconds": is_seconds,
        "exact_mean": m_ex, "exact_cov": C_ex, "is_mean": m_is, "is_cov": C_is,
        "is_vs_exact_mean_mse": float(np.mean((m_is - m_ex) ** 2)),
        "is_vs_exact_cov_mse": float(np.mean((C_is - C_ex) ** 2)),
        "ep": run(), "pep_u0.8": run(power=0.8), "rep_c20": run(relax_c=20.0),
    }
    out["pep_sweep"] = {f"{u:g}": run(power=u) for u in (0.2, 0.4, 0.6, 0.8, 0.9, 1.0)}
    out["rep_sweep"] = {f"{c:g}": run(relax_c=c) for c in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 20.0, 100.0)}
    out["ep_damped"] = run(damping=args.damping)
    # issue 18: every reading at the paper's c = 20 and over the c range that changes the answer
    out["readings"] = {}
    for rd in args.readings:
        sweep = {f"{c:g}": run(relax_c=c, relax_reading=rd) for c in FIVE_C_SWEEP}
        best = min(sweep, key=lambda k: (not sweep[k]["converged"], sweep[k]["mean_mse_vs_is"]))
        out["readings"][rd] = {"c20": run(relax_c=20.0, relax_reading=rd), "sweep": sweep, "best_c": float(best)}
    # EP against exact as the mislabelled point moves, and every reading on the worst placement
    scan = []
    for p5 in OUTLIER_SCAN:
        X = np.vstack([FIVE_X[:4], [p5]])
        scan.append({"point": p5, **run(X, exact_posterior_2d(X, FIVE_Y, eps))})
    out["ep_outlier_scan"] = scan
    ref_alt = exact_posterior_2d(FIVE_X_ALT, FIVE_Y, eps)
    out["alt"] = {"X": FIVE_X_ALT, "exact_mean": ref_alt[0], "exact_cov": ref_alt[1],
                  "ep": run(FIVE_X_ALT, ref_alt), "ep_damped": run(FIVE_X_ALT, ref_alt, damping=args.damping),
                  "readings": {rd: {f"{c:g}": run(FIVE_X_ALT, ref_alt, relax_c=c, relax_reading=rd) for c in FIVE_C_SWEEP}
                               for rd in args.readings}}
    for sweep in [out["pep_sweep"], out["rep_sweep"]] + [r["sweep"] for r in out["readings"].values()]:
        for r in sweep.values():
            for k in ("mean", "cov"):
                r.pop(k)
    emit(out)
    return out


# =========================================================================== synthetic
def synthetic_data(n_per_class, rng):
    """Class 1 (label 1): one Gaussian; class 2 (label 0): an equal mixture of two Gaussians."""
    X1 = rng.multivariate_normal([0.0, -0.5], [[1.0, 0.0], [0.0, 0.5]], n_per_class)
    comp = rng.random(n_per_class) < 0.5
    X2 = np.where(comp[:, None], rng.normal([-2.0, 1.0], 0.6, (n_per_class, 2)),
                  rng.normal([2.0, 1.0], 0.6, (n_per_class, 2)))
    X = np.vstack([X1, X2])
    y = np.r_[np.ones(n_per_class, int), np.zeros(n_per_class, int)]
    p = rng.permutation(len(y))
    return X[p], y[p]


def select_by_evidence(X, y, length_scales, eps_grid):
    """Kernel width (and ε) maximising the EP evidence; EP run in parallel with damping 0.5
    (a selection run must converge for its evidence to mean anything)."""
    sel = GPClassifier(eps=eps_grid[0], schedule="parallel", damping=0.5, max_iter=200)
    sel.tune(X, y, length_scales, eps_grid=eps_grid, criterion="evidence")
    return sel.length_scale, sel.eps, sel.tuning_


def reading_cs(args, reading):
    """The c values run for ``reading``: ``--reading-grid READING=c1,c2`` or ``--reading-c``."""
    return getattr(args, "reading_grid_", {}).get(reading, args.reading_c)


def reading_key(reading, c):
    return f"rep_{reading}_c{c:g}"


def run_methods(X, y, Xt, yt, ls, eps, args, extra_rep_c=()):
    res = {}
    specs = [("ep", {}), ("pep", {"method": "pep", "power": 0.8}), ("rep", {"method": "rep", "relax_c": args.rep_c})]
    specs += [(f"rep_c{c:g}", {"method": "rep", "relax_c": c}) for c in extra_rep_c if c != args.rep_c]
    specs += [("ep_damped", {"damping": args.damping})]
    specs += [(reading_key(rd, c), {"method": "rep", "relax_c": c, "relax_reading": rd})
              for rd in args.readings for c in reading_cs(args, rd)]
    for name, kw in specs:
        t0 = time.perf_counter()
        g = GPClassifier(eps=eps, length_scale=ls, schedule="sequential", max_iter=args.max_iter,
                         warn_unconverged=False, **kw).fit(X, y)  # (convergence is reported)
        err = g.test_error(Xt, yt)
        h = g.result_.history
        res[name] = {
            "converged": g.converged_, "diverged": not g.converged_, "iterations": g.n_iter_,
            "test_error": err, "seconds": time.perf_counter() - t0,
            "R_last": float(g.R_history_[-1]), "R_min": float(np.min(g.R_history_)),
            "skipped_updates": int(g.result_.n_skipped),
            "relaxed_updates": int(sum(r.n_relaxed for r in h)),
            "log_evidence": g.log_evidence_,
        }
    return res


def synthetic(args):
    rows = []
    for noise in args.noise:
        for rep in range(args.first_repeat, args.first_repeat + args.repeats):
            rng = np.random.default_rng([args.seed, int(noise * 100), rep])
            X, y = synthetic_data(200, rng)
            Xt, yt = synthetic_data(args.n_test // 2, rng)
            flip = rng.random(len(y)) < noise
            yn = np.where(flip, 1 - y, y)
            t0 = time.perf_counter()
            ls, eps, _ = select_by_evidence(X, yn, args.length_scales, [noise])
            sel_s = time.perf_counter() - t0
            res = run_methods(X, yn, Xt, yt, ls, eps, args, extra_rep_c=args.extra_rep_c)
            row = {"section": "synthetic", "noise": noise, "repeat": rep, "flipped": float(flip.mean()),
                   "length_scale": ls, "eps": eps, "selection_seconds": sel_s, "n_train": len(y),
                   "n_test": len(yt), **res}
            emit(row)
            rows.append(row)
    return rows


# =========================================================================== UCI
def uci(args):
    rows = []
    jobs = [(name, 0.0) for name in args.uci] + [("spam", float(r)) for r in args.spam_noise]
    for name, flip_rate in jobs:
        for rep in range(args.first_repeat, args.first_repeat + args.uci_repeats):
            split = paper_split(name, random_state=rep) if name != "spam" else \
                train_test_split(load(name), 276, random_state=rep)
            Xtr, ytr, Xte, yte = split.X_train, split.y_train, split.X_test, split.y_test
            if flip_rate > 0:
                rng = np.random.default_rng([rep, 17])
                ytr = np.where(rng.random(len(ytr)) < flip_rate, 1 - ytr, ytr)
                yte = np.where(rng.random(len(yte)) < flip_rate, 1 - yte, yte)
            d = Xtr.shape[1]
            grid = [np.sqrt(d) * f for f in args.uci_width_factors]
            eps_grid = [flip_rate] if flip_rate >= 0.05 else list(args.uci_eps)
            t0 = time.perf_counter()
            ls, eps, _ = select_by_evidence(Xtr, ytr, grid, eps_grid)
            sel_s = time.perf_counter() - t0
            res = run_methods(Xtr, ytr, Xte, yte, ls, eps, args, extra_rep_c=())
            row = {"section": "uci", "dataset": name, "label_flip": flip_rate, "repeat": rep,
                   "n_train": len(ytr), "n_test": len(yte), "length_scale": ls, "eps": eps,
                   "selection_seconds": sel_s, **res}
            emit(row)
            rows.append(row)
    return rows


# =========================================================================== Laplace
def laplace(args):
    rows = []
    for name in (("heart",) if args.quick else ("heart", "pima")):
        split = paper_split(name, random_state=args.seed, add_bias=True)
        out = {"section": "laplace", "dataset": name, "n_train": len(split.y_train)}
        models = {}
        for label, op in (("ep", LogisticOperator()), ("laplace_propagation", LaplaceOperator(Logistic()))):
            t0 = time.perf_counter()
            m = BayesianLogisticRegression(op, tol=1e-8, max_iter=200, damping=0.0).fit(split.X_train, split.y_train)
            models[label] = m
            out[label] = {"converged": m.converged_, "iterations": m.n_iter_, "seconds": time.perf_counter() - t0,
                          "test_error": m.test_error(split.X_test, split.y_test),
                          "log_evidence": m.log_evidence_}
        a, b = models["ep"].posterior_, models["laplace_propagation"].posterior_
        sd = np.sqrt(np.diag(a.cov))
        out["max_mean_diff_in_ep_sd"] = float(np.max(np.abs(a.mean - b.mean) / sd))
        out["sd_ratio_range"] = [float(np.min(np.sqrt(np.diag(b.cov)) / sd)), float(np.max(np.sqrt(np.diag(b.cov)) / sd))]
        emit(out)
        rows.append(out)
    return rows


# =========================================================================== issue 18
def _agg(rows, key):
    return {"test_error": float(np.mean([r[key]["test_error"] for r in rows])),
            "divergences": int(sum(r[key]["diverged"] for r in rows)),
            "relaxed_updates": int(sum(r[key]["relaxed_updates"] for r in rows))}


def rep_readings(five, syn, uci_rows, args):
    """Per reading: the synthetic test error and divergences at the c (of ``--reading-c``) with
    the lowest mean test error — chosen on the test sets, i.e. the most favourable choice for REP
    — with the whole c table; the five-point errors against the IS posterior at the paper's
    c = 20 and at the c of the sweep closest to it (best_c); UCI errors at the synthetic best c."""
    out = {}
    for rd in args.readings:
        r = {"reading": rd}
        if syn:
            cs = [c for c in reading_cs(args, rd) if all(reading_key(rd, c) in row for row in syn)]
            by_c = {f"{c:g}": _agg(syn, reading_key(rd, c)) for c in cs}
            best = min(by_c, key=lambda k: (by_c[k]["divergences"], by_c[k]["test_error"]))
            ep = _agg(syn, "ep")
            r.update({"c": float(best), "test_error": by_c[best]["test_error"],
                      "divergences": by_c[best]["divergences"], "relaxed_updates": by_c[best]["relaxed_updates"],
                      "test_error_minus_ep": by_c[best]["test_error"] - ep["test_error"],
                      "divergences_minus_ep": by_c[best]["divergences"] - ep["divergences"], "by_c": by_c})
        if five:
            f = five["readings"][rd]
            r.update({"five_point_c": 20.0,
                      "five_point_mean_mse": f["c20"]["mean_mse_vs_is"], "five_point_cov_mse": f["c20"]["cov_mse_vs_is"],
                      "five_point_converged": f["c20"]["converged"],
                      "five_point_best": {"c": f["best_c"], **{k: f["sweep"][f"{f['best_c']:g}"][k] for k in (
                          "mean_mse_vs_is", "cov_mse_vs_is", "converged", "outcome", "relaxed_updates")}},
                      "five_point_sweep": {c: {"mean_mse": v["mean_mse_vs_is"], "cov_mse": v["cov_mse_vs_is"],
                                               "outcome": v["outcome"], "relaxed_updates": v["relaxed_updates"]}
                                           for c, v in f["sweep"].items()}})
            alt = five.get("alt", {}).get("readings", {}).get(rd)
        if five and alt:
            ba = min(alt, key=lambda k: (not alt[k]["converged"], alt[k]["mean_mse_vs_exact"]))
            r["five_point_alt_best"] = {"c": float(ba), **{k: alt[ba][k] for k in (
                "mean_mse_vs_exact", "cov_mse_vs_exact", "boundary_angle_error_deg", "outcome", "relaxed_updates")}}
        if uci_rows and "c" in r and all(reading_key(rd, r["c"]) in row for row in uci_rows):
            k = reading_key(rd, r["c"])
            agg = {}
            for row in uci_rows:
                key = row["dataset"] + (f"+flip{row['label_flip']:g}" if row["label_flip"] else "")
                agg.setdefault(key, []).append(row[k]["test_error"])
            r["uci_test_error"] = {k2: float(np.mean(v)) for k2, v in agg.items()}
        out[rd] = r
    base = {}
    if syn:
        base = {m: _agg(syn, m) for m in ("ep", "ep_damped", "pep")}
    if five:
        for m, k in (("ep", "ep"), ("ep_damped", "ep_damped"), ("pep", "pep_u0.8")):
            base.setdefault(m, {}).update({"five_point_mean_mse": five[k]["mean_mse_vs_is"],
                                           "five_point_cov_mse": five[k]["cov_mse_vs_is"]})
            if m in five.get("alt", {}):
                a = five["alt"][m]
                base[m]["five_point_alt"] = {k: a[k] for k in ("mean_mse_vs_exact", "cov_mse_vs_exact",
                                                                "boundary_angle_error_deg", "outcome")}
    out["baselines"] = base
    ranked = [rd for rd in args.readings if "test_error" in out[rd]]
    if ranked:
        out["best_reading"] = min(ranked, key=lambda rd: (out[rd]["divergences"], out[rd]["test_error"]))
        b = out[out["best_reading"]]
        out["best_reading_relaxes"] = b["relaxed_updates"] > 0  # False: its best c is EP in disguise
        out["best_reading_beats_ep"] = bool(b["test_error_minus_ep"] < 0 and b["divergences_minus_ep"] <= 0)
    elif five:
        out["best_reading"] = min(args.readings, key=lambda rd: out[rd]["five_point_mean_mse"])
    else:
        out["best_reading"] = None
    return out


# =========================================================================== main
def summarise(five, syn, uci_rows, args, seconds):
    s = {"summary": True, "quick": args.quick, "seconds": seconds}
    if syn:
        for m in ("ep", "pep", "rep"):
            s[f"{m}_test_error"] = float(np.mean([r[m]["test_error"] for r in syn]))
            s[f"{m}_divergences"] = int(sum(r[m]["diverged"] for r in syn))
            its = [r[m]["iterations"] for r in syn if r[m]["converged"]]
            s[f"{m}_mean_iterations_converged"] = float(np.mean(its)) if its else None
        s["rep_c"] = args.rep_c
        s["synthetic_runs"] = len(syn)
        s["synthetic_by_noise"] = {
            f"{noise:g}": {m: {"test_error": float(np.mean([r[m]["test_error"] for r in syn if r["noise"] == noise])),
                               "divergences": int(sum(r[m]["diverged"] for r in syn if r["noise"] == noise))}
                           for m in ("ep", "pep", "rep")}
            for noise in args.noise}
        extra = sorted({k for r in syn for k in r if k.startswith("rep_c")})
        for k in extra:
            s[f"{k}_test_error"] = float(np.mean([r[k]["test_error"] for r in syn]))
            s[f"{k}_divergences"] = int(sum(r[k]["diverged"] for r in syn))
    if five:
        s["five_point"] = {k: {"mean_mse": five[k]["mean_mse_vs_exact"], "cov_mse": five[k]["cov_mse_vs_exact"]}
                           for k in ("ep", "pep_u0.8", "rep_c20")}
    s["rep_readings"] = rep_readings(five, syn, uci_rows, args)
    if syn:
        s["ep_damped_test_error"] = float(np.mean([r["ep_damped"]["test_error"] for r in syn]))
        s["ep_damped_divergences"] = int(sum(r["ep_damped"]["diverged"] for r in syn))
    if uci_rows:
        agg = {}
        for r in uci_rows:
            key = r["dataset"] + (f"+flip{r['label_flip']:g}" if r["label_flip"] else "")
            a = agg.setdefault(key, {m: [] for m in ("ep", "pep", "rep")})
            for m in a:
                a[m].append(r[m]["test_error"])
        s["uci_test_error"] = {k: {m: float(np.mean(v)) for m, v in a.items()} for k, a in agg.items()}
    emit(s)


def combine(paths, args):
    """The summary of earlier runs' JSON lines (e.g. sections or noise levels run in parallel)."""
    five, syn, uci_rows, readings, reading_c, noise = None, [], [], [], [], []
    grid = {}  # reading -> the c values some run used for it
    seen = set()  # a data set run twice (same seed) is counted once
    for path in paths:
        for line in open(path):
            row = json.loads(line)
            sec = row.get("section")
            if sec == "config":
                readings += [r for r in row.get("readings", []) if r not in readings]
                reading_c += [c for c in row.get("reading_c", []) if c not in reading_c]
                for rd, cs in row.get("reading_grid_", {}).items():  # each run's --reading-grid
                    grid.setdefault(rd, [])
                    grid[rd] += [c for c in cs if c not in grid[rd]]
                noise += [x for x in row.get("noise", []) if x not in noise] if "synthetic" in row["sections"] else []
            elif sec == "five_point":
                five = row
            elif sec == "synthetic" and ("syn", row["noise"], row["repeat"]) not in seen:
                seen.add(("syn", row["noise"], row["repeat"]))
                syn.append(row)
            elif sec == "uci" and ("uci", row["dataset"], row["label_flip"], row["repeat"]) not in seen:
                seen.add(("uci", row["dataset"], row["label_flip"], row["repeat"]))
                uci_rows.append(row)
    args.readings, args.reading_c, args.noise = readings, sorted(reading_c), sorted(noise)
    for rd, cs in grid.items():  # --reading-grid given to --combine itself wins
        args.reading_grid_.setdefault(rd, sorted(cs))
    args.quick = False
    summarise(five, syn, uci_rows, args, None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sections", nargs="+", default=["five_point", "synthetic", "uci", "laplace"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--is-samples", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--noise", type=float, nargs="+", default=[0.1, 0.2])
    p.add_argument("--n-test", type=int, default=None)
    p.add_argument("--max-iter", type=int, default=None)
    p.add_argument("--rep-c", type=float, default=0.1)
    p.add_argument("--extra-rep-c", type=float, nargs="*", default=None,
                   help="further REP weights run on the synthetic problems (default: the paper's 10; none with --quick)")
    p.add_argument("--length-scales", type=float, nargs="+", default=[0.3, 0.6, 1.2, 2.4])
    p.add_argument("--uci", nargs="+", default=None)
    p.add_argument("--spam-noise", type=float, nargs="*", default=None)
    p.add_argument("--uci-repeats", type=int, default=None)
    p.add_argument("--uci-width-factors", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--uci-eps", type=float, nargs="+", default=[0.05, 0.15])
    p.add_argument("--readings", nargs="+", default=list(RELAX_READINGS), choices=RELAX_READINGS,
                   help="relaxed-EP readings to run (issue 18)")
    p.add_argument("--reading-c", type=float, nargs="+", default=None,
                   help="l1 weights c run for every reading on the synthetic and UCI problems "
                        "(default 0.03 0.3 3 with --quick, else 0.01 0.03 0.1 0.3 1 3 20)")
    p.add_argument("--reading-grid", nargs="+", default=[], metavar="READING=C1,C2",
                   help="per-reading c values (override --reading-c for that reading)")
    p.add_argument("--first-repeat", type=int, default=0,
                   help="index of the first repeat (data set / split seed), to split a run across processes")
    p.add_argument("--damping", type=float, default=0.5, help="damping of the EP baseline 'ep_damped'")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSONL",
                   help="print the summary of earlier runs' output files instead of running")
    args = p.parse_args(argv)
    args.reading_grid_ = {}
    for item in args.reading_grid:
        rd, _, cs = item.partition("=")
        if rd not in RELAX_READINGS or not cs:
            p.error(f"--reading-grid: expected READING=c1,c2 with READING in {RELAX_READINGS}, got {item!r}")
        args.reading_grid_[rd] = [float(c) for c in cs.split(",")]
    if args.combine:
        return combine(args.combine, args)
    q = args.quick
    args.is_samples = args.is_samples or (10_000_000 if q else 100_000_000)
    args.repeats = args.repeats or (1 if q else 10)
    args.n_test = args.n_test or (4000 if q else 39_600)
    args.max_iter = args.max_iter or (40 if q else 100)
    args.uci_repeats = args.uci_repeats or (1 if q else 10)
    args.uci = args.uci or (["heart", "haberman"] if q else ["heart", "pima", "haberman"])
    args.extra_rep_c = args.extra_rep_c if args.extra_rep_c is not None else ([] if q else [10.0])
    args.reading_c = args.reading_c or ([0.03, 0.3, 3.0] if q else [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 20.0])
    args.spam_noise = args.spam_noise if args.spam_noise is not None else ([0.1] if q else [0.05, 0.1, 0.2])
    if q:
        args.length_scales = args.length_scales[1:3] if len(args.length_scales) > 2 else args.length_scales
        args.uci_width_factors = [1.0, 2.0]
    emit({"section": "config", **{k: v for k, v in vars(args).items()}, "python": sys.version.split()[0]})
    t0 = time.perf_counter()
    five = five_point(args) if "five_point" in args.sections else None
    syn = synthetic(args) if "synthetic" in args.sections else []
    uci_rows = uci(args) if "uci" in args.sections else []
    if "laplace" in args.sections:
        laplace(args)
    summarise(five, syn, uci_rows, args, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
