#!/usr/bin/env python
"""A user's own factor, served with the oracle on the client ("bring your own sampler", issue 16).

The factor is the client's own code, defined in this file and never sent to the server: robust
logistic regression's likelihood, ``z = ε + (1 − 2ε)·σ(x)`` (ε = ``--eps``, label noise), a
``SampledFactor`` with Gaussian messages on x and Beta messages on z — the server has no factor of
that name and no code for it.  Its oracle is the per-message importance sampler
(:class:`kjit.oracles.MessageImportanceSampler`, ``--target-se`` standard error per coordinate)
running in this process.

Protocol.  A server (``python -m service``, empty store, no plugins: it only ever sees the
factor's variable names and families) is started in a subprocess.  A sequence of ``--problems``
robust logistic-regression problems (synthetic, the paper's: d = ``--d``, n = ``--n`` training
points with a fraction ε of labels flipped, 1 000 test points; ``kjit.datasets.synthetic_logistic``
with seeds 1000 + k) is solved by parallel-schedule EP (``BayesianLogisticRegression``, the
factor's operator asked for messages to x; ``--max-iter`` sweeps, no tolerance stop: sampled
answers never meet it) two ways, in the same run, one after the other:

* ``local sampling``: a sampler (its own generator) answers every message;
* ``client loop``: ``RemoteOperator(url, name, oracle=sampler)`` — the server predicts
  (``mode=predict``, one request per sweep) and marks the rows its just-in-time rule would
  consult (log predictive variance above its threshold, or an outgoing message whose precision's
  sign is undetermined); the client's sampler answers those, they are used and posted back as
  observations (one more request, with an Idempotency-Key).  The served operator does not exist
  when the sequence starts: during problem 1 the client's sampler answers the first ``--initial``
  messages (default 2n: EP's first two sweeps) and keeps them; then the operator is created from
  them (``POST /v1/operators``, ``source.kind = "client"``; threshold: the server's calibration on
  a held-out fifth, mean KL ≤ 1e-3, unless ``--threshold``) and answers the rest of problem 1.  So
  problem 1's client-loop time includes those sampler answers, the creation request and the
  training job (``create_seconds``), and its consultations include the initial pairs.

Per problem: ``consultations`` (rows the client's sampler answered) and ``requests`` (messages
asked), ``seconds`` (client loop, wall clock) split into ``oracle_seconds`` (the client's sampler),
``http_seconds`` (requests to the server, its work included) and the rest (EP, client-side
encoding), ``local_seconds``, ``speedup_vs_local_sampling`` (= local_seconds / seconds), test error
both ways, the server's operator version and ``n_train``.  Summary: ``consultation_rate_after_first``
(consultations / requests over problems 2..N), ``speedup_vs_local_sampling`` (total local seconds
/ total client-loop seconds over the sequence) and ``speedup_vs_local_sampling_after_first``; goal
≥ 5× over the sequence (``goal_met``).  BLAS is limited to one thread (the machine is shared);
both ways run in this process with the same settings.

Prints one JSON object per line; the last is the summary.  ``--quick``: 4 smaller problems, a
looser target standard error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root before benchmarks/

from kjit.factors import SampledFactor  # noqa: E402
from kjit.families import Beta, Gaussian  # noqa: E402


def robust_logistic(eps: float) -> SampledFactor:
    """The client's factor: z = ε + (1 − 2ε)·σ(x) (a label flips with probability ε)."""
    return SampledFactor("robust_logistic", inputs={"x": Gaussian}, output=("z", Beta),
                         sampler=lambda v, rng: eps + (1 - 2 * eps) / (1 + np.exp(-v["x"])))


def emit(obj) -> None:
    print(json.dumps(obj), flush=True)


class Counting:
    """Counts the messages asked of an operator."""

    def __init__(self, op):
        self.op = op
        self.factor = op.factor
        self.requests = 0

    def belief(self, incoming, to):
        self.requests += len(incoming["x"])
        return self.op.belief(incoming, to)


class Bootstrap:
    """The client loop before the served operator exists: the client's oracle answers (and the
    pairs are kept) until ``n_initial`` pairs are in; then ``create(incoming, beliefs)`` makes the
    served operator from them and every later call goes to it (a ``RemoteOperator``)."""

    def __init__(self, oracle, n_initial: int, create):
        self.oracle = oracle
        self.factor = oracle.factor
        self.n_initial = int(n_initial)
        self.create = create
        self.pairs = []
        self.remote = None
        self.create_seconds = None

    def belief(self, incoming, to):
        if self.remote is None and sum(len(b) for _, b in self.pairs) >= self.n_initial:
            t = time.perf_counter()
            inc = {v: type(self.pairs[0][0][v]).concatenate([p[0][v] for p in self.pairs]) for v in incoming}
            bel = type(self.pairs[0][1]).concatenate([p[1] for p in self.pairs])
            self.n_initial = len(bel)
            self.remote = self.create(inc, bel)
            self.create_seconds = time.perf_counter() - t
        if self.remote is not None:
            return self.remote.belief(incoming, to)
        q = self.oracle.belief(incoming, to)
        self.pairs.append((incoming, q))
        return q


class Timed:
    """An oracle that adds the seconds spent in it to ``seconds``."""

    def __init__(self, oracle):
        self.oracle = oracle
        self.factor = oracle.factor
        self.seconds = 0.0

    def belief(self, incoming, to):
        t = time.perf_counter()
        try:
            return self.oracle.belief(incoming, to)
        finally:
            self.seconds += time.perf_counter() - t


def _timed_remote():
    """RemoteOperator that adds the seconds of its HTTP requests (round trip, the server's work
    included) to ``http_seconds``."""
    from kjit.client import RemoteOperator

    class TimedRemote(RemoteOperator):
        http_seconds = 0.0

        def _request(self, *args, **kw):
            t = time.perf_counter()
            try:
                return super()._request(*args, **kw)
            finally:
                TimedRemote.http_seconds += time.perf_counter() - t

    return TimedRemote


def create(http, url, incoming, beliefs, args, name, oracle):
    """``POST /v1/operators`` (``source.kind = "client"``) with the first pairs; wait for the job;
    the served operator as a ``RemoteOperator`` with the client's oracle."""

    body = {"name": name, "factor": "robust_logistic", "to": "x", "n_inner": args.n_inner, "n_outer": args.n_outer,
            "threshold": args.threshold, "random_state": args.seed,
            "source": {"kind": "client", "variables": {"x": "gaussian", "z": "beta"}, "output": "z",
                       "incoming": {v: wire(m) for v, m in incoming.items()}, "beliefs": wire(beliefs)}}
    r = http.post("/v1/operators", json=body)
    if r.status_code != 202:
        raise RuntimeError(f"creating the operator failed: {r.status_code} {r.text}")
    while (job := http.get(r.headers["location"]).json())["status"] not in ("succeeded", "failed"):
        time.sleep(0.02)
    if job["status"] != "succeeded":
        raise RuntimeError(f"the training job failed: {job}")
    return _timed_remote()(url, name, oracle=oracle)


def wire(m) -> dict:
    from kjit.families import family_name

    return {"family": family_name(type(m)), **{p: np.asarray(v, float).ravel().tolist()
                                               for p, v in zip(m.param_names, m.params)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true", help="4 smaller problems, target_se 3e-2")
    ap.add_argument("--problems", type=int, default=None, help="problems in the sequence (default 10; quick 4)")
    ap.add_argument("--d", type=int, default=None, help="dimension (default 20; quick 10)")
    ap.add_argument("--n", type=int, default=None, help="training points per problem (default 300; quick 200)")
    ap.add_argument("--eps", type=float, default=0.05, help="label-flip probability of the factor and the data")
    ap.add_argument("--target-se", type=float, default=None,
                    help="the sampler's standard error per coordinate (default 1e-2; quick 3e-2)")
    ap.add_argument("--max-iter", type=int, default=10, help="EP sweeps per problem")
    ap.add_argument("--initial", type=int, default=None,
                    help="pairs of problem 1 the operator is created from (default 2n: EP's first two sweeps)")
    ap.add_argument("--threshold", type=float, default=None,
                    help="the served operator's threshold (default: the server calibrates it)")
    ap.add_argument("--n-inner", type=int, default=200)
    ap.add_argument("--n-outer", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick
    problems = args.problems or (4 if q else 10)
    d, n = args.d or (10 if q else 20), args.n or (200 if q else 300)
    target_se = args.target_se or (3e-2 if q else 1e-2)
    args.initial = args.initial or 2 * n

    from threadpoolctl import threadpool_limits

    import httpx

    from kjit.datasets import synthetic_logistic
    from kjit.ep.models import BayesianLogisticRegression
    from kjit.oracles import MessageImportanceSampler
    from service.testing import SubprocessServer

    limits = threadpool_limits(limits=1, user_api="blas")  # noqa: F841 - kept for the whole run
    factor = robust_logistic(args.eps)
    client_sampler = Timed(MessageImportanceSampler(factor, target_se=target_se, random_state=args.seed + 1))
    local_sampler = MessageImportanceSampler(factor, target_se=target_se, random_state=args.seed + 2)

    def problem(k):
        X, y, Xt, yt, _ = synthetic_logistic(d=d, n=n, n_test=1000, random_state=1000 + k)
        flip = np.random.default_rng(2000 + k).random(n) < args.eps
        return X, np.where(flip, 1 - y, y), Xt, yt

    def ep(op, X, y):
        t = time.perf_counter()
        model = BayesianLogisticRegression(op, max_iter=args.max_iter, tol=0.0, compute_evidence=False, damping=0.0,
                                           on_uncertain="warn", warn_unconverged=False).fit(X, y)  # (fixed sweeps)
        return model, time.perf_counter() - t

    def skipped(model):
        return int(sum(r.n_skipped for r in model.result_.history))

    rows = []
    name = "robust-logistic-x"
    with tempfile.TemporaryDirectory(prefix="kjit-client-oracle-") as tmp:
        srv = SubprocessServer(Path(tmp) / "store", env={"KJIT_LOG_LEVEL": "warning"}).start(timeout=120)
        remote = None
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as http:
                boot = Bootstrap(client_sampler, args.initial,
                                 lambda inc, bel: create(http, srv.url, inc, bel, args, name, client_sampler))
                for k in range(problems):
                    X, y, Xt, yt = problem(k)
                    local = Counting(local_sampler)
                    m_local, s_local = ep(local, X, y)
                    row = {"bench": "client_oracle", "problem": k + 1, "d": d, "n": n}
                    op = boot if k == 0 else remote
                    c0 = remote.consultations_ if remote is not None else 0
                    o0, h0 = client_sampler.seconds, (type(remote).http_seconds if remote is not None else 0.0)
                    counted = Counting(op)
                    m_remote, s_remote = ep(counted, X, y)
                    if k == 0:
                        remote = boot.remote
                        if remote is None:
                            raise RuntimeError(f"problem 1 asked for fewer than --initial={args.initial} messages")
                        info = remote.info(refresh=True)
                        row.update({"initial_pairs": boot.n_initial, "create_seconds": boot.create_seconds,
                                    "threshold": info.get("threshold")})
                    info = remote.info(refresh=True)
                    consultations = remote.consultations_ - c0 + (boot.n_initial if k == 0 else 0)
                    row.update({"requests": counted.requests, "consultations": consultations,
                                "seconds": s_remote, "oracle_seconds": client_sampler.seconds - o0,
                                "http_seconds": type(remote).http_seconds - h0, "test_error": m_remote.test_error(Xt, yt),
                                "skipped_updates": skipped(m_remote)})
                    row.update({"local_seconds": s_local, "local_test_error": m_local.test_error(Xt, yt),
                                "local_skipped_updates": skipped(m_local),
                                "speedup_vs_local_sampling": s_local / row["seconds"],
                                "version": info["version"], "n_train": info["n_train"]})
                    rows.append(row)
                    emit(row)
        finally:
            if remote is not None:
                remote.close()
            srv.stop()
    later = rows[1:]
    total = lambda key, rs: float(sum(r[key] for r in rs))  # noqa: E731
    speedup = total("local_seconds", rows) / total("seconds", rows)
    summary = {
        "bench": "client_oracle_summary", "problems": problems, "d": d, "n": n, "target_se": target_se,
        "max_iter": args.max_iter, "threshold": rows[0]["threshold"],
        "consultations": [r["consultations"] for r in rows],
        "consultation_rate_after_first": total("consultations", later) / max(1.0, total("requests", later)),
        "speedup_vs_local_sampling": speedup,
        "speedup_vs_local_sampling_after_first": (total("local_seconds", later) / total("seconds", later)
                                                  if later else None),
        "max_test_error_gap": float(max(abs(r["test_error"] - r["local_test_error"]) for r in rows)),
        "seconds": total("seconds", rows), "local_seconds": total("local_seconds", rows),
        "oracle_seconds": total("oracle_seconds", rows), "http_seconds": total("http_seconds", rows),
        "create_seconds": rows[0]["create_seconds"],
        "goal": 5.0, "goal_met": bool(speedup >= 5.0),
    }
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
