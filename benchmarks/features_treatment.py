"""Inner random features: cost of the "gaussian" vs "exact" treatment, and how far apart they are.

Inputs: 3000 logistic-factor message pairs (Gaussian x, Beta z), Gaussian means U(-10, 10),
variances loguniform(0.01, 100); Beta messages one third Beta(2, 1), one third Beta(1, 2) (the
label messages of logistic regression) and one third Beta(alpha, beta) with alpha, beta
independently loguniform(0.5, 1000).  D_in = 500, D_out = 1000, median heuristic widths.

Prints JSON lines:
  {"kind": "timing", "treatment", "dtype", "us_per_msg" (inner), "us_per_msg_transform", ...}
  {"kind": "difference", "group", ...}: per group of Beta messages, how different the two
      embeddings are -- relative distance of the inner features, the mean |chi_Beta - chi_moment
      matched Gaussian| over the drawn frequencies, and the disagreement of the inner-product
      kernels phi(r).phi(s) within the group.

``--quick``: the same protocol at smaller sizes -- 600 message pairs, D_in = 100, D_out = 200,
1 timing repeat (a few seconds).

Usage: python benchmarks/features_treatment.py [--quick] [--n 3000] [--repeats 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kjit.families import Beta, Gaussian
from kjit.features import TwoStageFeatures, characteristic_function


def logistic_inputs(n: int, rng: np.random.Generator):
    mean = rng.uniform(-10.0, 10.0, n)
    var = np.exp(rng.uniform(np.log(0.01), np.log(100.0), n))
    group = rng.integers(0, 3, n)
    a = np.exp(rng.uniform(np.log(0.5), np.log(1000.0), n))
    b = np.exp(rng.uniform(np.log(0.5), np.log(1000.0), n))
    a = np.where(group == 0, 2.0, np.where(group == 1, 1.0, a))
    b = np.where(group == 0, 1.0, np.where(group == 1, 2.0, b))
    return (Gaussian(mean, var), Beta(a, b)), group


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (caches, BLAS threads)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="600 pairs, D_in 100, D_out 200, 1 repeat")
    p.add_argument("--n", type=int, default=None, help="message pairs (default 3000; --quick 600)")
    p.add_argument("--repeats", type=int, default=None, help="timing repeats, best kept (default 5; --quick 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n is None:
        args.n = 600 if args.quick else 3000
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    sizes = {"n_inner": 100, "n_outer": 200} if args.quick else {"n_inner": 500, "n_outer": 1000}
    rng = np.random.default_rng(args.seed)
    msgs, group = logistic_inputs(args.n, rng)
    n = args.n

    fitted = {}
    for treatment in ("gaussian", "exact"):
        for dtype in (np.float64, np.float32):
            f = TwoStageFeatures((Gaussian, Beta), treatment=treatment, random_state=args.seed, dtype=dtype,
                                 **sizes)
            t_fit = best_time(lambda: f.fit(msgs), 1)
            t_inner = best_time(lambda: f.inner(msgs), args.repeats)
            t_trans = best_time(lambda: f.transform(msgs), args.repeats)
            t_one = best_time(lambda: f.inner((msgs[0][:1], msgs[1][:1])), args.repeats * 20)
            row = {
                "kind": "timing",
                "treatment": treatment,
                "dtype": np.dtype(dtype).name,
                "n": n,
                "n_inner": f.n_inner,
                "n_outer": f.n_outer,
                "us_per_msg": round(t_inner / n * 1e6, 3),
                "us_per_msg_transform": round(t_trans / n * 1e6, 3),
                "us_single_msg_inner": round(t_one * 1e6, 1),
                "fit_s": round(t_fit, 3),
                "sigma2": [round(float(s), 6) for s in f.sigma2_],
                "gamma2": round(f.gamma2_, 6),
            }
            if treatment == "exact":
                # the Beta component's (index 1) exact-treatment plan: (Chebyshev nodes, coefficients)
                row["beta_chebyshev_nodes"] = int(f._inner_arrays(f.dtype)["plans"][1][0])
            print(json.dumps(row), flush=True)
            fitted[(treatment, np.dtype(dtype).name)] = f

    # ---------------------------------------------------------------- how different?
    fg, fe = fitted[("gaussian", "float64")], fitted[("exact", "float64")]
    assert np.array_equal(fg.omega_, fe.omega_) and np.array_equal(fg.b_, fe.b_)  # same draws
    phi_g, phi_e = fg.inner(msgs), fe.inner(msgs)
    beta = msgs[1]
    w = fe.omega_[1]
    chi_b = characteristic_function(beta, w)
    chi_n = characteristic_function(Gaussian(beta.mean(), beta.var()), w)
    names = {0: "Beta(2,1)", 1: "Beta(1,2)", 2: "Beta(loguniform(0.5,1000)^2)"}
    sub_rng = np.random.default_rng(args.seed + 1)
    for gid in (0, 1, 2):
        idx = np.flatnonzero(group == gid)
        d = np.linalg.norm(phi_e[idx] - phi_g[idx], axis=1) / np.linalg.norm(phi_e[idx], axis=1)
        cf = np.abs(chi_b[idx] - chi_n[idx]).mean(axis=1)
        sub = np.sort(sub_rng.choice(idx, min(300, idx.size), replace=False))
        Kg, Ke = phi_g[sub] @ phi_g[sub].T, phi_e[sub] @ phi_e[sub].T
        iu = np.triu_indices(sub.size, 1)
        print(json.dumps({
            "kind": "difference",
            "group": names[gid],
            "n": int(idx.size),
            "rel_dist_phi_median": round(float(np.median(d)), 5),
            "rel_dist_phi_p90": round(float(np.quantile(d, 0.9)), 5),
            "mean_abs_chi_beta_minus_gauss_median": round(float(np.median(cf)), 5),
            "kernel_abs_diff_mean": round(float(np.abs(Kg - Ke)[iu].mean()), 5),
            "kernel_abs_diff_max": round(float(np.abs(Kg - Ke)[iu].max()), 5),
            "kernel_corr": round(float(np.corrcoef(Kg[iu], Ke[iu])[0, 1]), 5),
        }), flush=True)
    # across groups: the whole kernel matrix on a random subset
    sub = np.sort(sub_rng.choice(n, min(900, n), replace=False))
    Kg, Ke = phi_g[sub] @ phi_g[sub].T, phi_e[sub] @ phi_e[sub].T
    iu = np.triu_indices(sub.size, 1)
    print(json.dumps({
        "kind": "difference",
        "group": "all (random subset)",
        "n": int(sub.size),
        "kernel_abs_diff_mean": round(float(np.abs(Kg - Ke)[iu].mean()), 5),
        "kernel_abs_diff_max": round(float(np.abs(Kg - Ke)[iu].max()), 5),
        "kernel_corr": round(float(np.corrcoef(Kg[iu], Ke[iu])[0, 1]), 5),
    }), flush=True)
    # how far apart the two label messages Beta(2,1) and Beta(1,2) are embedded (MMD^2 of the
    # Beta component under the inner kernel, estimated on the drawn frequencies: mean |chi_a - chi_b|^2)
    labels = Beta(np.array([2.0, 1.0]), np.array([1.0, 2.0]))
    ce = characteristic_function(labels, w)
    cg = characteristic_function(Gaussian(labels.mean(), labels.var()), w)
    print(json.dumps({
        "kind": "label_separation",
        "mmd2_exact": round(float(np.mean(np.abs(ce[0] - ce[1]) ** 2)), 5),
        "mmd2_gaussian": round(float(np.mean(np.abs(cg[0] - cg[1]) ** 2)), 5),
        "sigma2_beta": round(float(fe.sigma2_[1]), 5),
    }), flush=True)
    if (group == 2).any():
        idx = np.flatnonzero(group == 2)
        s = beta.alpha[idx] + beta.beta[idx]
        cf = np.abs(chi_b[idx] - chi_n[idx]).mean(axis=1)
        for lo, hi in ((0, 10), (10, 100), (100, 1000), (1000, 3000)):
            m = (s >= lo) & (s < hi)
            if m.any():
                print(json.dumps({
                    "kind": "difference_by_concentration",
                    "alpha_plus_beta": [lo, hi],
                    "n": int(m.sum()),
                    "mean_abs_chi_beta_minus_gauss_median": round(float(np.median(cf[m])), 6),
                }), flush=True)


if __name__ == "__main__":
    main()
