#!/usr/bin/env python
"""The continuous audit under drift: is a served operator's silent loss of accuracy caught, and
what does it cost?

Protocol.  A logistic→x operator is trained (quadrature oracle, ``--n-train`` pairs, D_in/D_out
``--d-in``/``--d-out``, hyperparameters by evidence) on ONE input distribution: x-messages
N(μ, v) with μ ~ U(−3, 3), log10 v ~ U(−1, 0.5), z the observed-label messages Beta(2, 1) /
Beta(1, 2); its JIT threshold is calibrated on 300 held-out pairs of that distribution (mean KL
≤ 1e-3, as the service's training does).  It is served by ``python -m service`` (a subprocess,
store of its own) with ``KJIT_AUDIT_RATE`` = ``--rate``, ``KJIT_AUDIT_KL_TARGET`` =
``--kl-target`` (default 1e-3: the operator's own calibration target), ``KJIT_AUDIT_CPU_SHARE`` =
0.1.  The client sends ``mode=jit`` requests of ``--batch`` messages: for the first
``--stationary`` requests from the training distribution, then drifting — the x-messages' means
shift by up to ``--max-shift`` and their variances grow by up to 10× linearly over
``--drift-requests`` requests, then stay there.  (Measured while designing this benchmark, in
process: without an audit, the JIT operator learning the consulted pairs online becomes confident
in the drifted region — consultation falls to 0 — while the p95 KL of its answers rises from
1e-7 to 3e-3: silent inaccuracy the predictive variance does not flag.)

Per window of ``--window`` requests one JSON line: ``requests`` (cumulative), ``shift``,
``audited`` (answers audited in the window), audited ``mean_kl`` / ``p95_kl`` (KL[oracle ‖ served]
of those audits, from the server's ``GET /v1/operators/{name}`` recent audits), ``true_p95_kl``
(the same KL computed here with quadrature for every learned answer of the window: an independent
check), ``threshold`` and ``consultation_rate``.  The threshold is polled (``GET``) every 25 requests;
the server CPU those polls cost is part of the server's CPU seconds below.
Summary line: ``drift_detected_after_requests`` (requests from the start of the drift to the first
threshold change the client saw; null if none), ``audited_kl_p95_after_adaptation`` (p95 of the
audits in the last ``--tail`` windows), ``true_kl_p95_after_adaptation``, ``audit_cpu_share``
(CPU seconds of the server's audit thread over the server process's CPU seconds, from /proc),
``audit_cpu_share_of_wall`` (audit CPU over the run's wall time), the goals and whether each was met.
``--quick``: a smaller operator and fewer requests.  ``--max-shift`` and ``--threshold`` (serve with a given
threshold instead of the calibrated one, e.g. the paper's −8.5) vary the scenario; ``--reference incoming``
trains the operator relative to the incoming message instead of the logistic factor's near-exact quadrature
reference (which keeps the operator accurate under this drift, so the audit has nothing to catch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root before benchmarks/

from kjit.factors import get_factor  # noqa: E402
from kjit.families import Beta, Gaussian  # noqa: E402
from kjit.oracles import QuadratureOracle  # noqa: E402


def messages(n, rng, shift=0.0, var_factor=1.0):
    y = rng.random(n) < 0.5
    m = rng.uniform(-3.0, 3.0, n) + shift
    v = 10 ** rng.uniform(-1.0, 0.5, n) * var_factor
    return {"x": Gaussian(m, v), "z": Beta(np.where(y, 2.0, 1.0), np.where(y, 1.0, 2.0))}


def body(inc):
    return {"to": "x", "incoming": {
        "x": {"family": "gaussian", "mean": inc["x"].mean().tolist(), "var": inc["x"].var().tolist()},
        "z": {"family": "beta", "alpha": inc["z"].alpha.tolist(), "beta": inc["z"].beta.tolist()}}}


def build(root: Path, n_train: int, d_in: int, d_out: int, threshold: float | None = None,
          reference: str = "auto") -> float:
    from kjit.operators import JITOperator, KernelOperator, calibrate_threshold
    from kjit.training import make_training_set
    from service.store import OperatorStore

    f = get_factor("logistic")
    quad = QuadratureOracle(f)
    ts = make_training_set(f, "x", lambda n, r: messages(n, r), quad, n=n_train, random_state=0)
    held = make_training_set(f, "x", lambda n, r: messages(n, r), quad, n=300, random_state=1)
    op = KernelOperator(f, "x", n_inner=d_in, n_outer=d_out, random_state=0, reference=reference).fit(ts)
    thr = calibrate_threshold(op, held, 1e-3) if threshold is None else float(threshold)
    store = OperatorStore(root)
    store.open()
    try:
        store.create("logistic-x", JITOperator(op, quad, threshold=thr),
                     {"training": {"n": n_train, "distribution": "mu ~ U(-3, 3), log10 v ~ U(-1, 0.5)"},
                      "threshold": thr})
    finally:
        store.close()
    return thr


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rate", type=float, default=0.1)
    p.add_argument("--kl-target", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--window", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shift", type=float, default=12.0, help="how far the x-messages' means drift")
    p.add_argument("--threshold", type=float, default=None,
                   help="serve with this JIT threshold instead of the calibrated one (e.g. the paper's -8.5)")
    p.add_argument("--reference", choices=["auto", "incoming"], default="auto",
                   help="the operator's reference of relative targets: auto (logistic's near-exact quadrature "
                        "reference, which keeps it accurate under this drift) or the incoming message (whose "
                        "drift the audit must catch)")
    args = p.parse_args(argv)
    q = args.quick
    n_train, d_in, d_out = (600, 60, 120) if q else (1000, 100, 200)
    stationary, drift, total = (400, 1200, 2800) if q else (400, 1500, 4400)
    max_shift = args.max_shift
    tail = 2 if q else 4

    import httpx
    from service.testing import SubprocessServer

    tmp = Path(tempfile.mkdtemp(prefix="kjit-audit-bench-"))
    try:
        thr0 = build(tmp / "store", n_train, d_in, d_out, args.threshold, args.reference)
        root = str(Path(__file__).resolve().parents[1])  # the server imports this checkout's `service` package,
        env = {"KJIT_AUDIT_RATE": str(args.rate), "KJIT_AUDIT_KL_TARGET": str(args.kl_target),  # not benchmarks/service.py
               "KJIT_AUDIT_CPU_SHARE": "0.1", "OPENBLAS_NUM_THREADS": "1", "KJIT_TOKEN": "",
               "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        quad = QuadratureOracle(get_factor("logistic"))
        rng = np.random.default_rng(args.seed)
        windows, detected_at, changes_seen = [], None, 0
        with SubprocessServer(tmp / "store", env=env) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            pid = srv.proc.pid
            cpu0, t0 = proc_cpu_seconds(pid), time.monotonic()
            a0 = c.get("/v1/operators/logistic-x").json()["audit"]
            seen_count = a0["count"]
            i = 0
            thr = thr0
            while i < total:
                n_req = n_cons = 0
                true_kl = []
                shift_w = 0.0
                for _ in range(args.window):
                    frac = min(max(i - stationary, 0) / drift, 1.0)
                    shift_w = max_shift * frac
                    inc = messages(args.batch, rng, shift_w, 10 ** frac)
                    r = c.post("/v1/operators/logistic-x/messages", params={"mode": "jit"}, json=body(inc))
                    r.raise_for_status()
                    out = r.json()
                    n_req += 1
                    n_cons += out["n_consulted"]
                    learned = ~np.asarray(out["consulted"], bool)
                    if learned.any():
                        served = Gaussian(np.asarray(out["beliefs"]["mean"])[learned],
                                          np.asarray(out["beliefs"]["var"])[learned])
                        sub = {v: m[learned] for v, m in inc.items()}
                        true_kl += np.asarray(quad.belief(sub, "x").kl(served)).tolist()
                    i += 1
                    if i % 25 == 0:
                        thr = float(c.get("/v1/operators/logistic-x").json()["threshold"])
                        if detected_at is None and thr < thr0 and i > stationary:
                            detected_at = i - stationary
                d = c.get("/v1/operators/logistic-x").json()
                a = d["audit"]
                new = a["count"] - seen_count
                seen_count = a["count"]
                kl = np.asarray(a["recent"]["kl"][-new:] if new else [], float)
                changes_seen = len(a["threshold_changes"])
                w = {"requests": i, "shift": round(shift_w, 3), "audited": int(new),
                     "mean_kl": float(kl.mean()) if kl.size else None,
                     "p95_kl": float(np.quantile(kl, 0.95)) if kl.size else None,
                     "true_p95_kl": float(np.quantile(true_kl, 0.95)) if true_kl else None,
                     "threshold": float(d["threshold"]), "consultation_rate": n_cons / (n_req * args.batch),
                     "threshold_changes": changes_seen, "dropped": a["server"]["dropped"]}
                windows.append((w, kl, np.asarray(true_kl)))
                print(json.dumps(w), flush=True)
            wall = time.monotonic() - t0
            cpu = proc_cpu_seconds(pid) - cpu0
            server = c.get("/v1/operators/logistic-x").json()["audit"]["server"]
        tail_kl = np.concatenate([k for _, k, _ in windows[-tail:]]) if windows else np.array([])
        tail_true = np.concatenate([t for _, _, t in windows[-tail:]]) if windows else np.array([])
        p95_after = float(np.quantile(tail_kl, 0.95)) if tail_kl.size else None
        share = server["cpu_seconds"] / cpu if cpu > 0 else None
        summary = {
            "summary": True, "quick": q, "rate": args.rate, "max_shift": max_shift, "reference": args.reference,
            "threshold_given": args.threshold, "kl_target": args.kl_target, "batch": args.batch,
            "stationary_requests": stationary, "drift_requests": drift, "total_requests": total,
            "initial_threshold": thr0, "final_threshold": thr, "threshold_changes": changes_seen,
            "drift_detected_after_requests": detected_at,
            "audited_kl_p95_after_adaptation": p95_after,
            "true_kl_p95_after_adaptation": float(np.quantile(tail_true, 0.95)) if tail_true.size else None,
            "audit_cpu_seconds": server["cpu_seconds"], "server_cpu_seconds": cpu, "wall_seconds": wall,
            "audit_cpu_share": share, "audit_cpu_share_of_wall": server["cpu_seconds"] / wall,
            "audited": server["picked"] - server["dropped"], "dropped": server["dropped"], "failed": server["failed"],
            "goal_detect_within_2000": detected_at is not None and detected_at <= 2000,
            "goal_p95_under_target": p95_after is not None and p95_after <= args.kl_target,
            "goal_cpu_share_le_10pct": share is not None and share <= 0.10,
        }
        print(json.dumps(summary), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
