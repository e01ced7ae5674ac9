#!/usr/bin/env python
"""Service replicas: what the shared update log costs per acknowledged update, and how fast a
replica merges the others' updates.

Protocol.  One logistic→x operator (D_in = 300, D_out = 500, ``--n-train`` quadrature pairs,
fixed hyperparameters; as in benchmarks/service.py) is written to a store, copied once per
configuration.  Configurations, measured in the same run: ``standalone`` (the local
append-only log, fsync'ed), ``directory`` (replica; shared log in a directory: flock, append,
fsync) and ``redis`` (replica; shared log in a Redis started here from Debian's redis-server with
``appendonly yes``, ``appendfsync always``; skipped when redis-server is not installed).  For
each: replica A (``python -m service``, its own loopback port and store) takes ``--reps``
observations of one pair each through ``RemoteOperator.observe`` (one keep-alive connection)
after warm-up; reported are p50/p99 of the round trip and ``ratio_to_standalone`` (p50 over the
standalone p50).  For the replica configurations a second replica B, started before A's stream
with background merges off, is then asked to merge (``POST .../merge``): ``merge_records_per_s``
= records applied / the request's wall time, and ``identical`` says whether A and B then predict
bit for bit identically.

Prints one JSON object per line; the last is a summary.  ``--quick``: fewer repetitions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _service_common import build_store, stats, timed  # noqa: E402


def start_redis(tmp: Path):
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    from service.testing import free_port

    port = free_port()
    (tmp / "redis").mkdir()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp / "redis"),
                             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_end = time.monotonic() + 20
    while time.monotonic() < t_end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--reps", type=int, default=None, help="observations per configuration (default 300, quick 60)")
    ap.add_argument("--n-train", type=int, default=None, help="training pairs of the benchmark operator")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import httpx

    from kjit.client import RemoteOperator
    from kjit.factors import Logistic
    from kjit.oracles import QuadratureOracle
    from service.testing import SubprocessServer
    from kjit.factors import logistic_incoming

    reps = args.reps or (60 if args.quick else 300)
    n_train = args.n_train or (300 if args.quick else 1000)
    rng = np.random.default_rng(args.seed)
    obs_inc = logistic_incoming(reps + 2, rng)
    beliefs = QuadratureOracle(Logistic()).belief(obs_inc, "x")
    test = logistic_incoming(200, rng)
    rows, summary = [], {"bench": "replicas_summary", "reps": reps}
    with tempfile.TemporaryDirectory(prefix="kjit-replicas-") as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "base"
        build_store(base, n_train, 300, 500)
        redis_proc, redis_url = start_redis(tmp)
        configs = [("standalone", None), ("directory", str(tmp / "shared-dir"))]
        configs.append(("redis", redis_url) if redis_url else ("redis", "skip"))
        try:
            for kind, shared in configs:
                if shared == "skip":
                    print(json.dumps({"bench": "replicas_observations", "config": kind,
                                      "skipped": "redis-server not installed"}), flush=True)
                    continue
                env = {"KJIT_LOG_LEVEL": "warning", "KJIT_MERGE_INTERVAL": "0"}
                if shared:
                    env["KJIT_SHARED_STORE"] = shared
                store_a = tmp / f"{kind}-a"
                shutil.copytree(base, store_a)
                (store_a / ".lock").unlink(missing_ok=True)
                a = SubprocessServer(store_a, env=env).start()
                b = None
                try:
                    if shared:  # replica B: an empty store, adopts A's operator from the shared store
                        b = SubprocessServer(tmp / f"{kind}-b", env=env).start()
                    with RemoteOperator(a.url, "logistic-x") as ra:
                        i = iter(range(reps + 2))

                        def one():
                            k = next(i)
                            ra.observe({v: m[k:k + 1] for v, m in obs_inc.items()}, beliefs[k:k + 1])

                        p50, p99, mean = stats(timed(one, reps))
                        row = {"bench": "replicas_observations", "config": kind, "reps": reps,
                               "remote_p50_ms": round(p50, 3), "remote_p99_ms": round(p99, 3),
                               "updates_per_s": round(1 / mean, 1)}
                        if b is not None:
                            with httpx.Client(base_url=b.url, timeout=600) as cb:
                                t = time.perf_counter()
                                m = cb.post("/v1/operators/logistic-x/merge").json()
                                dt = time.perf_counter() - t
                                with RemoteOperator(b.url, "logistic-x", mode="predict") as rb, \
                                        RemoteOperator(a.url, "logistic-x", mode="predict") as rpa:
                                    qa, lva, _ = rpa.predict(test)
                                    qb, lvb, _ = rb.predict(test)
                            row.update({"merged": m["merged"], "merge_seconds": round(dt, 4),
                                        "merge_records_per_s": round(m["merged"] / dt, 1),
                                        "identical": bool(qa == qb and np.array_equal(lva, lvb))})
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    for srv in (b, a):
                        if srv is not None:
                            srv.stop()
        finally:
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait(timeout=20)
    std = next(r for r in rows if r["config"] == "standalone")["remote_p50_ms"]
    for r in rows:
        summary[f"{r['config']}_p50_ms"] = r["remote_p50_ms"]
        summary[f"{r['config']}_ratio_to_standalone"] = round(r["remote_p50_ms"] / std, 2)
        if "identical" in r:
            summary[f"{r['config']}_identical_after_merge"] = r["identical"]
            summary[f"{r['config']}_merge_records_per_s"] = r["merge_records_per_s"]
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
