#!/usr/bin/env python
"""Training-set generation throughput: joblib's local backend vs a Dask cluster, and a projection.

Protocol: ``make_training_set`` for the logistic factor → x with the importance-sampling oracle
(``--particles``, the paper's 5×10^5 by default) on ``--n`` messages from the default input
distribution, cut into chunks of ``--chunk`` messages, same seed everywhere.  Timed runs:

* joblib's local backend (loky processes) with ``n_jobs`` 1 and 2;
* a ``distributed.LocalCluster`` on loopback with 1, 2 and 4 worker processes (one thread each)
  through ``joblib.parallel_config(backend="dask")`` — the path ``kjit train --scheduler`` takes.
  joblib runs a cluster with a single worker thread in the *calling* process (it short-circuits
  ``n_jobs == 1``), so the 1-worker row is measured with ``client.map`` of the very same chunk tasks
  (``kjit.training._chunk_job``, same chunks, same SeedSequence children) instead.

Every process computes with single-threaded BLAS: loky's workers (2 on 2 cores) and Dask's
(threads_per_worker=1 sets OMP/OPENBLAS_NUM_THREADS=1) do so by themselves, and the n_jobs=1 run
is put under ``threadpool_limits(1)`` so that the per-pair cost is that of one core (OpenBLAS's
two threads on a busy 2-core machine ran the oracle 2× slower).  Cluster start-up and the workers' first imports are excluded (a warm-up task runs first).  This
machine has 2 cores that the client, the scheduler and the workers share: 4 workers cannot beat 2,
and the ratios are reported as measured.

Scheduler overhead: ``--overhead-tasks`` no-op tasks through the same path on the 2-worker cluster;
``overhead_s_per_task`` is the wall time a task costs a worker slot beyond its work
(elapsed × workers / tasks) and ``max_task_rate`` (tasks / elapsed) bounds how fast one client and
one scheduler hand out tasks.

Projection for W workers, with c the per-pair cost, k the chunk size and o the overhead per task:

    pairs/s(W) ≈ min( W · k / (c · k + o),  k · max_task_rate )

so the scheduler is not the bottleneck while c · k ≫ o.  Chunk rule: make a chunk cost
≥ max(100 ms, 20 · o) (overhead ≤ 5 %), i.e. k ≥ max(0.1 s, 20 · o) / c, and keep ≥ 4 chunks per
worker for load balance; ``min_chunk`` is that k for the measured c and o.

Results are identical for the same seed whatever the backend (each chunk's sampler is seeded by
its own SeedSequence child): ``identical_to_local`` is true when every Dask run's pairs equal the
local n_jobs=1 run's, checked with ``np.array_equal`` on every parameter array.

Prints one JSON object per line: one per configuration, the overhead, the projection, then a
summary holding ``pairs_per_s``, ``per_pair_s``, ``overhead_s_per_task`` and ``identical_to_local``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import joblib
import numpy as np
from joblib import Parallel, delayed
from threadpoolctl import threadpool_limits

from kjit.factors import Logistic
from kjit.oracles import ImportanceSamplingOracle
from kjit.training import _chunk_job, logistic_incoming, make_training_set


def _noop(i):
    return i


def same_pairs(a, b) -> bool:
    if a.meta != b.meta or set(a.incoming) != set(b.incoming) or type(a.beliefs) is not type(b.beliefs):
        return False
    arrays = [(p, q) for v in a.incoming for p, q in zip(a.incoming[v].params, b.incoming[v].params)]
    arrays += list(zip(a.beliefs.params, b.beliefs.params))
    return all(np.array_equal(p, q) for p, q in arrays)


def via_client_map(client, oracle, n, chunk, seed):
    """The same chunk tasks as make_training_set, submitted with client.map (for a 1-thread cluster)."""
    factor = oracle.factor
    sampler_seed, oracle_seed = np.random.SeedSequence(seed).spawn(2)
    incoming, _ = factor.check_incoming(logistic_incoming(n, np.random.default_rng(sampler_seed)), "x")
    starts = list(range(0, n, chunk))
    seeds = oracle_seed.spawn(len(starts))
    parts = [{v: m[s: s + chunk] for v, m in incoming.items()} for s in starts]
    futures = client.map(_chunk_job, [oracle] * len(parts), parts, ["x"] * len(parts), seeds,
                         [True] * len(parts), pure=False)
    results = client.gather(futures)
    ok = np.concatenate([r[1] for r in results])
    beliefs = factor.families["x"].concatenate([r[0] for r in results if r[0] is not None])
    keep = np.flatnonzero(ok)
    from kjit.training import TrainingSet

    meta = {"n_requested": n, "n_failed": int((~ok).sum()), "oracle": repr(oracle), "chunk_size": chunk}
    return TrainingSet(factor.name, "x", {v: m[keep] for v, m in incoming.items()}, beliefs, factor.params(), meta)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=320, help="training pairs per run (default 320)")
    ap.add_argument("--chunk", type=int, default=16, help="messages per task (default 16)")
    ap.add_argument("--particles", type=int, default=500_000, help="importance-sampling particles (default 5e5)")
    ap.add_argument("--workers", default="1,2,4", help="Dask worker counts (default 1,2,4)")
    ap.add_argument("--overhead-tasks", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per configuration, best kept (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small sizes, well under a minute")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.chunk, args.particles, args.overhead_tasks, args.repeat = 128, 8, 50_000, 200, 1
    try:
        import distributed
    except ImportError:
        raise SystemExit("benchmarks/scale.py needs Dask: pip install 'kjit[dask]'")

    factor = Logistic()
    oracle = ImportanceSamplingOracle(factor, n_samples=args.particles, random_state=0)
    kw = dict(n=args.n, chunk_size=args.chunk, random_state=args.seed)
    n_tasks = math.ceil(args.n / args.chunk)
    base = {"benchmark": "scale", "n": args.n, "chunk": args.chunk, "tasks": n_tasks, "particles": args.particles,
            "cores": os.cpu_count()}
    rows, results = [], {}
    load_before = os.getloadavg()[0]

    def best(fn):
        """(best wall time over --repeat runs, last result)"""
        times, out = [], None
        for _ in range(max(1, args.repeat)):
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
        return min(times), out

    def record(backend, workers, seconds, ts, **extra):
        row = {**base, "backend": backend, "workers": workers, "seconds": round(seconds, 4),
               "pairs_per_s": round(args.n / seconds, 3), **extra}
        rows.append(row)
        results[(backend, workers)] = ts
        print(json.dumps(row), flush=True)
        return row

    # ---------------------------------------------------------------- joblib's local backend
    for n_jobs in (1, 2):
        if n_jobs > 1:  # warm the loky pool up (process start and imports are not oracle work)
            Parallel(n_jobs=n_jobs)(delayed(_noop)(i) for i in range(4))
        with threadpool_limits(1):  # BLAS single-threaded, as in loky's and Dask's one-thread workers
            dt, ts = best(lambda: make_training_set(factor, "x", logistic_incoming, oracle, n_jobs=n_jobs, **kw))
        record("joblib-loky", n_jobs, dt, ts)
    local = results[("joblib-loky", 1)]
    per_pair = rows[0]["seconds"] / args.n

    # ---------------------------------------------------------------- Dask LocalCluster on loopback
    overhead = None
    for w in [int(x) for x in args.workers.split(",")]:
        with distributed.LocalCluster(n_workers=w, processes=True, threads_per_worker=1, dashboard_address=None,
                                      host="127.0.0.1") as cluster, distributed.Client(cluster) as client:
            client.wait_for_workers(w)
            client.run(lambda: __import__("kjit.training"))  # workers' imports, outside the timing
            client.gather(client.map(_noop, range(4 * w), pure=False))
            if w == 1:
                dt, ts = best(lambda: via_client_map(client, oracle, args.n, args.chunk, args.seed))
                record("dask", w, dt, ts, via="client.map",
                       note="joblib runs a one-thread cluster's tasks in the calling process")
            else:
                with distributed.get_task_stream(client) as stream, joblib.parallel_config(backend="dask"):
                    dt, ts = best(lambda: make_training_set(factor, "x", logistic_incoming, oracle, **kw))
                on_workers = len({s["worker"] for s in stream.data})
                record("dask", w, dt, ts, via="joblib parallel_config(backend='dask')", workers_used=on_workers)
            if w == 2 or (overhead is None and w == max(int(x) for x in args.workers.split(","))):
                # no-op tasks through the same path (batch_size=1: one task per call, no joblib batching)
                k = args.overhead_tasks
                with joblib.parallel_config(backend="dask"):
                    Parallel(batch_size=1)(delayed(_noop)(i) for i in range(8))
                    t = time.perf_counter()
                    Parallel(batch_size=1)(delayed(_noop)(i) for i in range(k))
                    dt = time.perf_counter() - t
                t = time.perf_counter()
                client.gather(client.map(_noop, range(k), pure=False))
                dt_map = time.perf_counter() - t
                overhead = {"benchmark": "scale", "overhead_workers": w, "overhead_tasks": k,
                            "overhead_s_per_task": round(dt * w / k, 6), "max_task_rate": round(k / dt, 1),
                            "client_map_s_per_task": round(dt_map * w / k, 6),
                            "client_map_task_rate": round(k / dt_map, 1)}
                print(json.dumps(overhead), flush=True)

    # ---------------------------------------------------------------- ratios, projection, summary
    one = rows[0]["pairs_per_s"]
    for row in rows:
        row["speedup_vs_local_1"] = round(row["pairs_per_s"] / one, 3)
    identical = all(same_pairs(local, ts) for key, ts in results.items() if key[0] == "dask")
    o, rate, k = overhead["overhead_s_per_task"], overhead["max_task_rate"], args.chunk
    min_chunk = math.ceil(max(0.1, 20 * o) / per_pair)
    projection = {
        "benchmark": "scale", "formula": "pairs/s(W) = min(W*k/(c*k + o), k*max_task_rate)",
        "c_per_pair_s": round(per_pair, 6), "k_chunk": k, "o_s_per_task": o, "max_task_rate": rate,
        "min_chunk": min_chunk,
        "pairs_per_s": {str(W): round(min(W * k / (per_pair * k + o), k * rate), 1) for W in (2, 8, 32, 128, 512)},
        "pairs_per_s_at_min_chunk": {
            str(W): round(min(W * min_chunk / (per_pair * min_chunk + o), min_chunk * rate), 1)
            for W in (2, 8, 32, 128, 512)},
    }
    print(json.dumps(projection), flush=True)
    summary = {
        "benchmark": "scale", "summary": True, "n": args.n, "chunk": args.chunk, "particles": args.particles,
        "cores": os.cpu_count(), "per_pair_s": round(per_pair, 6),
        "pairs_per_s": {f"{r['backend']}-{r['workers']}": r["pairs_per_s"] for r in rows},
        "speedup_vs_local_1": {f"{r['backend']}-{r['workers']}": r["speedup_vs_local_1"] for r in rows},
        "overhead_s_per_task": o, "max_task_rate": rate, "min_chunk": min_chunk,
        "projected_pairs_per_s": projection["pairs_per_s"],
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "identical_to_local": bool(identical),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
