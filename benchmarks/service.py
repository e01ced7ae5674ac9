#!/usr/bin/env python
"""Message-operator service: round-trip latency and throughput against the in-process operator.

Protocol.  One logistic→x operator of the default size (D_in = 300, D_out = 500; fitted on
``--n-train`` quadrature pairs from the default incoming distribution with fixed
hyperparameters — the benchmark measures serving, not accuracy) is written to a temporary
store (or ``--store`` is used as it is).  The service runs as its own process (``python -m
service``, a real uvicorn on a free 127.0.0.1 port).  For batches of 1, 100 and 10 000
messages drawn from the default distribution, the client (``kjit.client.RemoteOperator``,
``mode="predict"``, one keep-alive connection) asks for beliefs ``--reps`` times (fewer for the
big batch) after warm-up calls; the same inputs go to the same operator loaded in this process
(``KernelOperator.belief``).  Reported per batch size: p50 and p99 of the per-call wall time
(ms), throughput (messages per second = batch / mean call time) for both, and
``ratio_to_inprocess`` = remote p50 / in-process p50.  A last line gives the durable
observation round trip (batch of 1: apply, append to the log, fsync, respond).

Prints one JSON object per line.  ``--quick``: fewer repetitions and a smaller fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _service_common import build_store, stats as _stats, timed as _timed  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller fit")
    ap.add_argument("--store", default=None, help="use this store (with a logistic-x operator) instead of a new one")
    ap.add_argument("--reps", type=int, default=None, help="calls per batch size (default 300, quick 60)")
    ap.add_argument("--n-train", type=int, default=None, help="training pairs of the benchmark operator")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from kjit.client import RemoteOperator
    from service.testing import SubprocessServer
    from kjit.factors import logistic_incoming
    from kjit.persistence import loads_state
    from kjit.operators import JITOperator

    reps = args.reps or (60 if args.quick else 300)
    n_train = args.n_train or (300 if args.quick else 1000)
    tmp = None
    if args.store:
        store = Path(args.store)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kjit-bench-")
        store = Path(tmp.name) / "store"
        t = time.perf_counter()
        build_store(store, n_train, 300, 500)
        print(json.dumps({"bench": "service_setup", "n_train": n_train, "n_inner": 300, "n_outer": 500,
                          "fit_seconds": round(time.perf_counter() - t, 2)}), flush=True)
    snaps = sorted((store / "operators" / "logistic-x").glob("snapshot-*.npz"))
    kind, state = loads_state(snaps[-1].read_bytes())
    local = JITOperator.from_state_dict(state).operator if kind == "JITOperator" else None
    if local is None:
        from kjit.operators import KernelOperator

        local = KernelOperator.from_state_dict(state)

    rng = np.random.default_rng(args.seed)
    env = {"KJIT_MAX_BATCH": "10000", "KJIT_LOG_LEVEL": "warning"}
    with SubprocessServer(store, env=env) as srv, RemoteOperator(srv.url, "logistic-x", mode="predict") as remote:
        remote.info()
        for batch in (1, 100, 10_000):
            r = max(5, reps // (30 if batch >= 10_000 else (3 if batch >= 100 else 1)))
            inc = logistic_incoming(batch, rng)
            q_remote = remote.belief(inc)
            q_local = local.belief(inc)
            max_diff = float(np.max(np.abs(q_remote.mean() - q_local.mean())))
            t_remote = _timed(lambda: remote.belief(inc), r)
            t_local = _timed(lambda: local.belief(inc), r)
            rp50, rp99, rmean = _stats(t_remote)
            lp50, lp99, lmean = _stats(t_local)
            print(json.dumps({
                "bench": "service_messages", "mode": "predict", "batch": batch, "reps": r,
                "remote_p50_ms": round(rp50, 3), "remote_p99_ms": round(rp99, 3),
                "remote_msgs_per_s": round(batch / rmean, 1),
                "inprocess_p50_ms": round(lp50, 3), "inprocess_p99_ms": round(lp99, 3),
                "inprocess_msgs_per_s": round(batch / lmean, 1),
                "ratio_to_inprocess": round(rp50 / lp50, 2), "max_abs_diff_mean": max_diff,
            }), flush=True)
        # durable observation round trip (batch of 1)
        from kjit.oracles import QuadratureOracle

        obs_inc = logistic_incoming(reps, rng)
        beliefs = QuadratureOracle(local.factor).belief(obs_inc, "x")
        i = iter(range(reps + 2))

        def one():
            k = next(i) % reps
            remote.observe({v: m[k:k + 1] for v, m in obs_inc.items()}, beliefs[k:k + 1])

        t_obs = _timed(one, reps)
        op50, op99, omean = _stats(t_obs)
        print(json.dumps({"bench": "service_observations", "batch": 1, "reps": reps, "remote_p50_ms": round(op50, 3),
                          "remote_p99_ms": round(op99, 3), "remote_per_s": round(1 / omean, 1)}), flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
