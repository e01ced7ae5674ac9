#!/usr/bin/env python
"""The service's default operators: do they answer confidently and wrong?

Protocol.  Each trainable default direction (``service.training.default_specs()``; ``--names`` for some) is trained
exactly as the server trains it at first start (``service.training.train_operator`` with the settings' default
sizes — 4 000 pairs, D_in 500, D_out 1 000, seed 0 — its calibrated threshold, density guard, input margin and
expected-KL cap ``KL_CAP``), round-tripped through its saved state as the store serves it, then asked about
``--n`` fresh messages of the factor's default distribution (seed 777, disjoint from training) twice: as
``mode=predict`` (``JITOperator.screen_certified``: an answer is confident when its certificate says so and the rule
does not mark it uncertain) and as ``mode=jit`` (``JITOperator.certified`` on a copy, in requests of 100 messages,
learning as the server does: an answer is confident when it was not consulted).  Each confident answer is compared
with the factor's exact rule (``QuadratureOracle``; messages it refuses are left out).  ``--no-cap`` asks the same
operators with the cap removed (``kl_cap=None``: the rule before the forty-fifth session), in the same run.

One JSON line per (direction, mode): ``consulted`` (share not confident), ``n_confident``, ``median_kl`` and
``max_kl`` of the confident answers, ``n_above_1e-3`` / ``n_above_0.1`` / ``n_above_1``; then, per direction, a line
with the training's ``threshold``, ``held_out_consulted_share`` and ``train_seconds``.  ``--quick``: the four
directions served at first start plus probit_noise → f and product → z, 1 000 pairs at D 100/200, 1 000 messages.

    OMP_NUM_THREADS=1 python benchmarks/served_defaults.py [--quick] [--no-cap] [--names probit_noise-f ...]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUICK_NAMES = ("logistic-x", "logistic-z", "compound_gamma-tau", "exp-x", "probit_noise-f", "product-z")
REQUEST = 100  # messages a mode=jit request


def _take(inc, idx):
    return {v: m[idx] for v, m in inc.items()}


def _exact(oracle, inc, to):
    """(kept rows, the exact beliefs of those): rows the exact rule refuses are left out."""
    from kjit.errors import OracleError

    n = len(next(iter(inc.values())))
    keep, parts = np.ones(n, bool), []
    for s in range(0, n, 200):
        idx = np.arange(s, min(n, s + 200))
        while idx.size:
            try:
                parts.append(oracle.belief(_take(inc, idx), to).ravel())
                break
            except OracleError as exc:
                rows = getattr(exc, "rows", None)
                bad = np.arange(idx.size) if rows is None else np.asarray(rows)
                keep[idx[bad]] = False
                idx = np.delete(idx, bad)
    return keep, type(parts[0]).concatenate(parts)


def _figures(kl, confident) -> dict:
    k = kl[confident]
    return {"consulted": round(float(1 - confident.mean()), 4), "n_confident": int(confident.sum()),
            "median_kl": float(np.median(k)) if k.size else None, "max_kl": float(k.max()) if k.size else None,
            "n_above_1e-3": int((k > 1e-3).sum()), "n_above_0.1": int((k > 0.1).sum()), "n_above_1": int((k > 1).sum())}


def ask(jit, inc, exact) -> dict:
    """mode=predict and mode=jit figures of ``jit`` on ``inc`` against ``exact``."""
    q, cert, uncertain = jit.screen_certified(inc)
    confident = np.asarray(cert.confident, bool) & ~np.asarray(uncertain, bool).reshape(-1)
    out = {"predict": _figures(np.asarray(exact.kl(q.ravel()), float), confident)}
    j = copy.deepcopy(jit)
    n = len(exact)
    qs, consulted = [], []
    for s in range(0, n, REQUEST):
        qq, c = j.certified(_take(inc, np.arange(s, min(n, s + REQUEST))), jit.to)
        qs.append(qq.ravel())
        consulted.append(np.asarray(c.source != "learned"))
    q_j = type(qs[0]).concatenate(qs)
    out["jit"] = _figures(np.asarray(exact.kl(q_j), float), ~np.concatenate(consulted))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="six directions, smaller operators, 1 000 messages")
    ap.add_argument("--names", nargs="*", help="directions, e.g. probit_noise-f (default: every trainable one)")
    ap.add_argument("--n", type=int, default=None, help="fresh messages per direction (3 000, quick 1 000)")
    ap.add_argument("--no-cap", action="store_true", help="also ask each operator without its expected-KL cap")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from kjit.learn.jit import JITOperator
    from kjit.oracles import QuadratureOracle
    from kjit.training import default_incoming
    from service.settings import Settings
    from service.training import TrainSpec, default_specs, train_operator

    settings = Settings()
    sizes = (1000, 100, 200) if args.quick else (settings.default_n_train, settings.default_n_inner,
                                                 settings.default_n_outer)
    specs = default_specs()
    names = args.names or (list(QUICK_NAMES) if args.quick else list(specs))
    n = args.n or (1000 if args.quick else 3000)
    for name in names:
        factor, to = specs[name]
        t = time.perf_counter()
        jit, _, info = train_operator(TrainSpec(factor=factor, to=to, n=sizes[0], n_inner=sizes[1], n_outer=sizes[2],
                                                random_state=settings.seed, n_jobs=1))
        seconds = time.perf_counter() - t
        jit = JITOperator.from_state_dict(jit.state_dict())  # (as the store serves it)
        inc = default_incoming(jit.factor)(n, np.random.default_rng(777))
        keep, exact = _exact(QuadratureOracle(jit.factor), inc, to)
        inc = _take(inc, np.flatnonzero(keep))
        print(json.dumps({"bench": "served_default", "op": name, "n_train": sizes[0], "n_inner": sizes[1],
                          "n_outer": sizes[2], "threshold": info["threshold"], "kl_cap": jit.kl_cap,
                          "held_out_consulted_share": info.get("held_out_consulted_share"),
                          "train_seconds": round(seconds, 1), "n_messages": int(keep.sum())}), flush=True)
        variants = [("cap", jit)]
        if args.no_cap:
            bare = copy.deepcopy(jit)
            bare.kl_cap = None
            variants.append(("no_cap", bare))
        for variant, op in variants:
            for mode, fig in ask(op, inc, exact).items():
                print(json.dumps({"bench": "served_default_answers", "op": name, "rule": variant, "mode": mode,
                                  **fig}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
