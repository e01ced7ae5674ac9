"""Learning curves of the learned operator per (factor, direction): what limits its accuracy.

Protocol: the messages of ``factor_suite.py`` (recorded from EP runs of a model that uses the
factor, training and test problems disjoint, targets from the exact rule); for every
(``--pairs`` n, ``--d-out`` D) a ``KernelOperator`` (the library's defaults, D_in = D/2) is fitted
on the first n training pairs and evaluated on the same ``--n-test`` test pairs.  One JSON line
per fit: ``mean_log_kl`` (test), ``train_mean_log_kl`` (on the pairs it was fitted to),
``noise_var`` and ``width_rule`` (what the evidence chose), ``fit_seconds``.

Reading the curve: test ≈ train and flat in n but falling in D → the feature map is the limit;
falling in n → more pairs help; train far below test → the operator interpolates its pairs but
does not generalise (the inputs' coverage or the kernel's invariances are the limit).

    python benchmarks/factor_curve.py [--quick] [--factors product gaussian] [--pairs 1000 5000] [--d-out 250 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import factor_suite as fs  # noqa: E402

from kjit.families import Gamma, Gaussian  # noqa: E402
from kjit.operators import KernelOperator  # noqa: E402
from kjit.oracles import QuadratureOracle  # noqa: E402
from kjit.training import TrainingSet  # noqa: E402


def _mean_log_kl(exact, pred):
    return float(np.mean(np.log(np.maximum(exact.kl(pred), 1e-300))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="product only, pairs 500/2000, D_out 250/500")
    ap.add_argument("--factors", nargs="*", default=["product", "logistic", "probit_noise", "exp"])
    ap.add_argument("--pairs", nargs="*", type=int, default=[1000, 2500, 5000, 10000])
    ap.add_argument("--d-out", nargs="*", type=int, default=[250, 1000])
    ap.add_argument("--n-test", type=int, default=3000)
    ap.add_argument("--directions", nargs="*", default=None, help="only these recipients")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.factors, args.pairs, args.d_out, args.n_test = ["product"], [500, 2000], [250, 500], 600
    for name in args.factors:
        rng = np.random.default_rng([args.seed, fs.FACTORS.index(name)])
        n_max = max(args.pairs)
        # the suite's problem count, scaled up for more than its 5 000 training pairs
        f, recs = fs.recordings(name, int(fs.PROBLEMS[name] * max(1.0, n_max / 5000)), rng)
        parts = fs._tuples(recs)
        k = len(parts)
        a, b = int(0.6 * k), int(0.75 * k)
        train_all, _ = fs._cat(parts[:a], rng, n_max)  # (messages, each row's problem index)
        test, _ = fs._cat(parts[b:], rng, args.n_test)
        exact = QuadratureOracle(f)
        n_avail = len(next(iter(train_all.values())))
        for to in f.variables:
            if args.directions and to not in args.directions:
                continue
            if f.families[to] not in (Gaussian, Gamma) and f.families[to].__name__ != "Beta":
                continue
            q_train_all = exact.belief(train_all, to)
            q_test = exact.belief(test, to)
            perm = rng.permutation(n_avail)
            for n in args.pairs:
                idx = np.sort(perm[: min(n, n_avail)])
                inc = {v: m[idx] for v, m in train_all.items()}
                data = TrainingSet(f.name, to, inc, q_train_all[idx], factor_params=f.params())
                for d in args.d_out:
                    t = time.perf_counter()
                    op = KernelOperator(f, to, n_inner=d // 2, n_outer=d, random_state=args.seed).fit(data)
                    secs = time.perf_counter() - t
                    row = {"factor": name, "direction": to, "pairs": len(idx), "d_out": d,
                           "mean_log_kl": _mean_log_kl(q_test, op.belief(test)),
                           "train_mean_log_kl": _mean_log_kl(data.beliefs, op.belief(inc)),
                           "noise_var": op.noise_var_, "width_rule": op.width_rule_, "canonical": op.canonical_,
                           "fit_seconds": secs}
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
