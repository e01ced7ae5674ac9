#!/usr/bin/env python
"""Message-operator service: round-trip latency and throughput against the in-process operator.

Protocol.  One logistic→x operator of the service's default size (``--n-inner`` 500,
``--n-outer`` 1000; the issue's first figures were at 300/500: pass those to compare) is fitted
on ``--n-train`` quadrature pairs from the default incoming distribution with fixed
hyperparameters (the benchmark measures serving, not accuracy) and written to a temporary
store (or ``--store`` is used as it is).  The service runs as its own process (``python -m
service``, a real uvicorn on a free 127.0.0.1 port).  For batches of 1, 100 and 10 000 messages
drawn from the default distribution, the client (``kjit.client.RemoteOperator``,
``mode="predict"``, one keep-alive connection) asks for beliefs ``--reps`` times (fewer for the
big batch) after warm-up calls.  The same inputs go to the same operator loaded in this process:
``inprocess_*`` is ``KernelOperator.predict`` — the work a ``mode=predict`` request does (belief
and log predictive variance, which the response carries); ``inprocess_belief_p50_ms`` is
``KernelOperator.belief`` (no variance) for reference.  ``floor_us_per_msg`` is the bare-BLAS
floor at the same shapes, per message: the operator's own matrices in the four products of a
prediction and nothing else (inner phases ``M ω``, ``cos``; outer ``φ ν + c``, ``cos``; mean
``ψ W``; variance ``rowsum((ψ Σ) ∘ ψ)``, for one message ``ψᵀ(Σψ)`` from one triangle of Σ by
``dsymv`` as the prediction computes it), timed the same way.  Reported per batch size: p50 and
p99 of the per-call wall time (ms), throughput (messages per second = batch / mean call time),
``ratio_to_inprocess`` = remote p50 / in-process p50 and ``inprocess_to_floor`` = in-process
p50 / floor p50; ``http_floor_p50_ms``: the same client call against a bare ASGI app under the
same uvicorn set-up that answers with the bytes the service answered (``_http_floor.py``: all the
client's work and the HTTP exchange, none of the server's), and ``server_p50_ms`` = remote p50 −
that floor, what the service adds.  Then the durable observation round trip (batch of 1:
validate, apply, append to the log, fsync, respond), and a summary line.  Calls of the five kinds
are interleaved (remote, in-process predict, in-process belief, floor, HTTP floor, remote, …) so
that the load of a shared machine hits them alike:
only ratios within one run are comparable, never absolute times across runs.

``--clients``: concurrency instead.  N = 1, 4, 16 client processes (no GIL shared between clients),
each with its own ``RemoteOperator`` (own keep-alive connection), send batch-1 predict requests to
one server for ``--duration`` seconds: total throughput (requests/s, calls wholly inside the window)
and p50/p99 per N.  Then reads during a
long update: one client posts observations of ``--update-rows`` rows (a long exclusive update:
features, BLR update, fsync) back to back while another sends batch-1 predictions to the same
operator and a third to a second operator; reported: the update's duration and the readers'
p50/p99/max, with the readers' p50/p99 when no update runs for comparison.  The same with ``mode=jit`` requests of
``--update-rows`` messages whose means are moved 6 beyond the training range (every row consulted: the oracle runs
for the whole batch; since the forty-third session a batch of ``ASIDE_ROWS`` rows or more is answered on a copy,
so the readers of that operator go on meanwhile), ``service_reads_during_jit``.  ``--replica``: the server is a
replica (``KJIT_SHARED_STORE``, a shared log in a temporary directory; its long jit requests are answered aside
since the forty-fifth session).

BLAS runs on ``--blas-threads`` threads (default 1) in this process and in the server.
``inprocess_to_floor`` is a floor's ratio at batch 1 only: for a larger batch the floor's variance is
the full ``(ψ Σ) ∘ ψ``, which the prediction may beat.  Prints one JSON object per line.  ``--quick``:
fewer repetitions and a smaller fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _blas import pin_blas_from_argv  # noqa: E402

#: the server's environment beyond the benchmark's own settings: its BLAS threads, as this process's
SERVER_ENV: dict = pin_blas_from_argv()  # (before numpy loads BLAS)

import numpy as np  # noqa: E402

# the repository root first: this file's name shadows the ``service`` package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from _service_common import build_store, stats as _stats  # noqa: E402


def _load_local(store: Path, name: str = "logistic-x"):
    from kjit.operators import JITOperator, KernelOperator
    from kjit.persistence import loads_state

    snaps = sorted((store / "operators" / name).glob("snapshot-*.npz"))
    kind, state = loads_state(snaps[-1].read_bytes())
    return JITOperator.from_state_dict(state).operator if kind == "JITOperator" else KernelOperator.from_state_dict(state)


def floor_fn(op, inc):
    """The bare arithmetic of ``op.predict(inc)``: the same products on the operator's own
    matrices (inner phases and cosine, outer features, mean, variance), no checks, no families."""
    feats, blr = op.features_, op.blr_
    n = len(inc[op.factor.variables[0]])
    om = np.ascontiguousarray(np.asarray(feats.omega_, float))  # (components, D_in)
    M = np.random.default_rng(0).standard_normal((n, om.shape[0]))  # the component means' shape
    b = np.asarray(feats.b_, float)
    nu, c = np.asarray(feats.nu_, float), np.asarray(feats.c_, float)
    W, S = np.asarray(blr.coef_, float), np.asarray(blr.Sigma_, float)
    assert M.shape == (n, om.shape[0]) and nu.shape[0] == om.shape[1] and S.shape[0] == nu.shape[1]

    from scipy.linalg.blas import dsymv

    F = S if S.flags.f_contiguous else S.T  # (symmetric: Fortran-ordered either way)

    def run():
        phi = np.cos(M @ om + b)
        psi = np.cos(phi @ nu + c)
        mean = psi @ W
        if n == 1:  # one row: the prediction reads one triangle of Σ (kjit.blr), so does its floor
            var = psi[0] @ dsymv(1.0, F, psi[0], lower=1)
        else:
            var = np.einsum("ij,ij->i", psi @ S, psi)
        return mean, var

    return run


def _interleaved(fns, reps, warmup=2):
    for fn in fns:
        for _ in range(warmup):
            fn()
    out = [[] for _ in fns]
    for _ in range(reps):
        for k, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t)
    return out


class _HttpFloor:
    """``_http_floor.py`` in its own process on a free port, answering ``get_body`` / ``other_body``."""

    def __init__(self, get_body: bytes, other_body: bytes):
        self.dir = tempfile.TemporaryDirectory(prefix="kjit-floor-")
        paths = [Path(self.dir.name) / n for n in ("get.json", "other.json")]
        for path, body in zip(paths, (get_body, other_body)):
            path.write_bytes(body)
        from service.testing import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        script = Path(__file__).resolve().parent / "_http_floor.py"
        self.proc = subprocess.Popen([sys.executable, str(script), str(self.port), *map(str, paths)])

    def __enter__(self):
        import socket

        t_end = time.monotonic() + 60
        while time.monotonic() < t_end:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the HTTP floor server did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.dir.cleanup()


def _last_response(remote, call):
    """``call()`` through ``remote`` with its session's answer kept: the raw bytes it received."""
    got = {}
    session = remote._session
    original = session.request

    def keep(*a, **k):
        got["r"] = original(*a, **k)
        return got["r"]

    session.request = keep
    try:
        call()
    finally:
        session.request = original
    return got["r"].content


def latency(args, store: Path) -> None:
    from kjit.client import RemoteOperator
    from kjit.factors import logistic_incoming
    from kjit.oracles import QuadratureOracle
    from service.testing import SubprocessServer

    reps = args.reps or (60 if args.quick else 300)
    local = _load_local(store)
    rng = np.random.default_rng(args.seed)
    env = {"KJIT_MAX_BATCH": "10000", "KJIT_LOG_LEVEL": "warning", **SERVER_ENV}
    summary = {}
    with SubprocessServer(store, env=env) as srv, RemoteOperator(srv.url, "logistic-x", mode="predict") as remote:
        remote.info()
        for batch in (1, 100, 10_000):
            r = max(5, reps // (30 if batch >= 10_000 else (3 if batch >= 100 else 1)))
            inc = logistic_incoming(batch, rng)
            q_remote = remote.belief(inc)
            q_local = local.belief(inc)
            max_diff = float(np.max(np.abs(q_remote.mean() - q_local.mean())))
            floor = floor_fn(local, inc)
            info = _last_response(remote, lambda: remote.info(refresh=True))
            answer = _last_response(remote, lambda: remote.belief(inc))
            with _HttpFloor(info, answer) as hf, RemoteOperator(hf.url, "logistic-x", mode="predict") as bare:
                bare.info()
                q_bare = bare.belief(inc)  # the same answer, from the fixed bytes
                assert np.array_equal(q_bare.mean(), q_remote.mean())
                t_remote, t_local, t_belief, t_floor, t_http = _interleaved(
                    [lambda: remote.belief(inc), lambda: local.predict(inc), lambda: local.belief(inc), floor,
                     lambda: bare.belief(inc)], r)
            rp50, rp99, rmean = _stats(t_remote)
            lp50, lp99, lmean = _stats(t_local)
            bp50, _, _ = _stats(t_belief)
            fp50, _, _ = _stats(t_floor)
            hp50, _, _ = _stats(t_http)
            print(json.dumps({
                "bench": "service_messages", "mode": "predict", "batch": batch, "reps": r,
                "n_inner": local.n_inner, "n_outer": local.n_outer,
                "remote_p50_ms": round(rp50, 3), "remote_p99_ms": round(rp99, 3),
                "remote_msgs_per_s": round(batch / rmean, 1),
                "inprocess_p50_ms": round(lp50, 3), "inprocess_p99_ms": round(lp99, 3),
                "inprocess_msgs_per_s": round(batch / lmean, 1), "inprocess_belief_p50_ms": round(bp50, 3),
                "ratio_to_inprocess": round(rp50 / lp50, 2),
                "floor_us_per_msg": round(fp50 * 1e3 / batch, 3), "inprocess_to_floor": round(lp50 / fp50, 2),
                "http_floor_p50_ms": round(hp50, 3), "server_p50_ms": round(rp50 - hp50, 3),
                "max_abs_diff_mean": max_diff,
            }), flush=True)
            summary[batch] = (rp50, rp50 / lp50, lp50 / fp50, hp50)
        # durable observation round trip (batch of 1)
        obs_inc = logistic_incoming(reps, rng)
        beliefs = QuadratureOracle(local.factor).belief(obs_inc, "x")
        i = iter(range(reps + 2))

        def one():
            k = next(i) % reps
            remote.observe({v: m[k:k + 1] for v, m in obs_inc.items()}, beliefs[k:k + 1])

        (t_obs,) = _interleaved([one], reps)
        op50, op99, omean = _stats(t_obs)
        print(json.dumps({"bench": "service_observations", "batch": 1, "reps": reps, "remote_p50_ms": round(op50, 3),
                          "remote_p99_ms": round(op99, 3), "remote_per_s": round(1 / omean, 1)}), flush=True)
    print(json.dumps({
        "bench": "service_summary", "n_inner": local.n_inner, "n_outer": local.n_outer,
        "batch1_remote_p50_ms": round(summary[1][0], 3), "batch1_ratio_to_inprocess": round(summary[1][1], 2),
        "batch1_inprocess_to_floor": round(summary[1][2], 2), "batch1_http_floor_p50_ms": round(summary[1][3], 3),
        "batch100_ratio_to_inprocess": round(summary[100][1], 2),
        "batch10000_ratio_to_inprocess": round(summary[10_000][1], 2),
        "observation_p50_ms": round(op50, 3), "observation_p99_ms": round(op99, 3),
        "note": "shared machine: compare ratios within one run only",
    }), flush=True)


def _reader(url, name, inc, stop, out, token=None):
    from kjit.client import RemoteOperator

    with RemoteOperator(url, name, mode="predict", token=token) as op:
        op.info()
        op.belief(inc)
        while not stop.is_set():
            t = time.perf_counter()
            op.belief(inc)
            out.append((t, time.perf_counter() - t))


def _client_process(url, name, seed, ready, go, window, out):
    """One client process (no shared GIL with the others): once every process is ``ready`` and
    ``go`` is set, batch-1 predictions during ``window`` = (start, end) (wall clock); puts the
    latencies of the calls made wholly inside the window."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kjit.client import RemoteOperator
    from kjit.factors import logistic_incoming

    inc = logistic_incoming(1, np.random.default_rng(seed))
    lat = []
    with RemoteOperator(url, name, mode="predict") as op:
        op.info()
        op.belief(inc)
        ready.put(1)
        go.wait()
        t_start, t_end = window[0], window[1]
        while time.time() < t_start:
            time.sleep(0.001)
        while True:
            t = time.time()
            if t >= t_end:
                break
            op.belief(inc)
            d = time.time() - t
            if t + d <= t_end:
                lat.append(d)
    out.put(lat)


def clients(args, store: Path) -> None:
    from kjit.client import RemoteOperator
    from kjit.factors import logistic_incoming
    from kjit.oracles import QuadratureOracle
    from service.testing import SubprocessServer

    rng = np.random.default_rng(args.seed)
    inc = logistic_incoming(1, rng)
    duration = args.duration or (2.0 if args.quick else 5.0)
    env = {"KJIT_MAX_BATCH": "10000", "KJIT_LOG_LEVEL": "warning", **SERVER_ENV}
    shared = tempfile.TemporaryDirectory(prefix="kjit-shared-") if args.replica else None
    if shared is not None:  # a replica: its updates go through a shared log in a directory
        env["KJIT_SHARED_STORE"] = shared.name
    with shared or contextlib.nullcontext(), SubprocessServer(store, env=env) as srv:  # (the server stops first)
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        for n in (1, 4, 16):
            q, ready, go, window = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Array("d", 2)
            procs = [ctx.Process(target=_client_process, args=(srv.url, "logistic-x", k, ready, go, window, q))
                     for k in range(n)]
            for p in procs:
                p.start()
            for _ in procs:  # every process started, connected and warm
                ready.get()
            window[0] = time.time() + 0.2
            window[1] = window[0] + duration
            go.set()
            lat = [d for _ in procs for d in q.get()]
            for p in procs:
                p.join()
            p50, p99, _ = _stats(lat)
            print(json.dumps({"bench": "service_clients", "clients": n, "mode": "predict", "batch": 1,
                              "requests": len(lat), "requests_per_s": round(len(lat) / duration, 1),
                              "p50_ms": round(p50, 3), "p99_ms": round(p99, 3)}), flush=True)

        # reads during a long update: an observations request of many rows holds logistic-x exclusively
        rows = args.update_rows or (500 if args.quick else 2000)
        obs_inc = logistic_incoming(rows, rng)
        beliefs = QuadratureOracle(_load_local(store).factor).belief(obs_inc, "x")

        jit_inc = {**obs_inc, "x": type(obs_inc["x"])(obs_inc["x"].mean() + 6.0, obs_inc["x"].var())}

        def run_readers(seconds, with_update, mode="observe"):
            stop = threading.Event()
            same, other, upd = [], [], []
            ts = [threading.Thread(target=_reader, args=(srv.url, "logistic-x", inc, stop, same)),
                  threading.Thread(target=_reader, args=(srv.url, "logistic-x-2", inc, stop, other))]
            for t in ts:
                t.start()
            time.sleep(0.3)
            same.clear()
            other.clear()
            if with_update:
                with RemoteOperator(srv.url, "logistic-x", mode="predict" if mode == "observe" else "jit") as w:
                    t_end = time.perf_counter() + seconds
                    while time.perf_counter() < t_end:
                        t = time.perf_counter()
                        if mode == "observe":
                            w.observe(obs_inc, beliefs)
                        else:
                            w.belief(jit_inc)
                        upd.append((t, time.perf_counter() - t))
            else:
                time.sleep(seconds)
            stop.set()
            for t in ts:
                t.join()
            return same, other, upd

        def row(kind, lat):
            d = [x for _, x in lat]
            p50, p99, _ = _stats(d)
            return {f"{kind}_p50_ms": round(p50, 3), f"{kind}_p99_ms": round(p99, 3),
                    f"{kind}_max_ms": round(max(d) * 1e3, 3), f"{kind}_n": len(d)}

        same0, other0, _ = run_readers(duration, False)
        same1, other1, upd = run_readers(duration, True)
        u = [d for _, d in upd]
        print(json.dumps({"bench": "service_reads_during_update", "replica": args.replica,
                          "update_rows": rows, "updates": len(u),
                          "update_p50_ms": round(float(np.median(u)) * 1e3, 3),
                          **row("idle_same_op", same0), **row("idle_other_op", other0),
                          **row("during_same_op", same1), **row("during_other_op", other1)}), flush=True)
        same2, other2, upd = run_readers(duration, True, mode="jit")
        u = [d for _, d in upd]
        print(json.dumps({"bench": "service_reads_during_jit", "replica": args.replica,
                          "jit_rows": rows, "jit_requests": len(u),
                          "jit_p50_ms": round(float(np.median(u)) * 1e3, 3),
                          **row("idle_same_op", same0), **row("idle_other_op", other0),
                          **row("during_same_op", same2), **row("during_other_op", other2)}), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller fit")
    ap.add_argument("--clients", action="store_true", help="concurrent clients and reads during a long update")
    ap.add_argument("--store", default=None, help="use this store (with a logistic-x operator) instead of a new one")
    ap.add_argument("--reps", type=int, default=None, help="calls per batch size (default 300, quick 60)")
    ap.add_argument("--n-train", type=int, default=None, help="training pairs of the benchmark operator")
    ap.add_argument("--n-inner", type=int, default=500, help="D_in of the benchmark operator (service default 500)")
    ap.add_argument("--n-outer", type=int, default=1000, help="D_out of the benchmark operator (service default 1000)")
    ap.add_argument("--duration", type=float, default=None, help="--clients: seconds per measurement (5, quick 2)")
    ap.add_argument("--update-rows", type=int, default=None, help="--clients: rows of the long update (2000, quick 500)")
    ap.add_argument("--replica", action="store_true",
                    help="--clients: serve as a replica (KJIT_SHARED_STORE: a shared log in a temporary directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blas-threads", type=int, default=1,
                    help="BLAS threads for this process and the server (default 1; 0: the library's default)")
    args = ap.parse_args(argv)  # (--blas-threads was applied at import: pin_blas_from_argv)

    n_train = args.n_train or (300 if args.quick else 1000)
    tmp = None
    if args.store:
        store = Path(args.store)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kjit-bench-")
        store = Path(tmp.name) / "store"
        t = time.perf_counter()
        build_store(store, n_train, args.n_inner, args.n_outer,
                    names=("logistic-x", "logistic-x-2") if args.clients else ("logistic-x",))
        print(json.dumps({"bench": "service_setup", "n_train": n_train, "n_inner": args.n_inner,
                          "n_outer": args.n_outer, "fit_seconds": round(time.perf_counter() - t, 2)}), flush=True)
    try:
        (clients if args.clients else latency)(args, store)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
