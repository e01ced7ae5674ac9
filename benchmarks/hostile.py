#!/usr/bin/env python
"""Hostile and extreme input against a real server (issue 21): status, field naming, state.

Protocol.  A temporary store gets three small operators (logistic→x, logistic→z, compound
gamma→τ; quadrature pairs from the default distributions; ``--quick``: 300 pairs, D_in = 50,
D_out = 100) and a server runs on it as its own process (``python -m service`` on a free
127.0.0.1 port) with a bearer token, a snapshot every 37 records and the default limits.  A
thread samples the server's resident memory (psutil) every 20 ms for the whole run.

Each *kind* of bad or extreme input (≥ 80: every parameter of every message with NaN/Infinity
tokens, overflowing literals, finite extremes, strings, booleans, nulls, out-of-range values;
malformed, non-UTF-8, deeply nested and 16 MiB bodies; wrong shapes, names, families, modes,
tokens; oversized oracle batches and training jobs; a training-queue flood; path traversal;
idempotency-key reuse; poisoned observations) is sent once.  Before and after, the state of
the operators it targets is fingerprinted (version, n_train, JIT counters, update counts, and a
``mode=predict`` answer for a fixed batch, compared bit for bit).  Per kind one JSON line:
``status``, ``names_field`` (an error item's ``loc`` starts with the field expected for the
kind), ``state_changed``, ``passed`` (the expected status class, no 5xx, the field named where
one is expected, state unchanged — for the accepted control kinds: changed as intended).
``/health`` is polled during the 16 MiB body (``health_max_ms``).

Recovery: two servers get the same store and the same ``--records`` honest observation records
(quadrature beliefs, 5 rows each, crossing the regression's fold and refactor boundaries); one
never restarts, the other is killed (SIGKILL) or stopped (SIGINT) at random versions and
restarted.  ``restart_bit_identical``: their ``mode=predict`` answers on 64 probe messages agree
bit for bit (JSON floats are exact).

Summary line: ``kinds``, ``passed``, ``server_errors`` (5xx answers or dropped connections),
``state_changed_on_reject``, ``poisoning_accepted`` (2xx to a poisoned observation),
``restart_bit_identical``, ``max_server_rss_mb`` (peak over the run).

``--job-memory`` (also run without ``--quick``): a server on an empty store trains the largest
job its limits allow (``KJIT_MAX_TRAIN_N``, ``KJIT_MAX_N_INNER``, ``KJIT_MAX_N_OUTER``; logistic→x,
quadrature oracle) and its peak resident memory is reported against its idle baseline.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


# ------------------------------------------------------------------------------ servers
class RssSampler:
    def __init__(self, period=0.02):
        self.period = period
        self.peak = 0
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid):
        self.pids.add(pid)

    def _run(self):
        while not self._stop.is_set():
            for pid in list(self.pids):
                try:
                    self.peak = max(self.peak, psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    self.pids.discard(pid)
            time.sleep(self.period)

    def start(self):
        self._t.start()
        return self

    def stop(self):
        self._stop.set()
        self._t.join()


def start_server(store: Path, sampler: RssSampler, extra_env=None):
    from service.testing import SubprocessServer

    env = {"KJIT_TOKEN": TOKEN, "KJIT_SNAPSHOT_EVERY": "37", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(extra_env or {})}
    srv = SubprocessServer(store, env=env).start()
    sampler.watch(srv.proc.pid)
    return srv


def build_store(root: Path, quick: bool) -> None:
    from service.store import OperatorStore
    from service.training import DEFAULT_DISTRIBUTIONS, TrainSpec, train_operator

    n, d_in, d_out = (300, 50, 100) if quick else (1000, 150, 300)
    store = OperatorStore(root)
    store.open()
    try:
        for name, factor, to in (("logistic-x", "logistic", "x"), ("logistic-z", "logistic", "z"),
                                 ("compound_gamma-tau", "compound_gamma", "tau")):
            jit, _, info = train_operator(TrainSpec(factor, to, n=n, n_inner=d_in, n_outer=d_out, threshold=0.0,
                                                    random_state=0))
            _, logvar = jit.operator.predict(DEFAULT_DISTRIBUTIONS[factor](400, np.random.default_rng(7)))
            jit.threshold = float(np.median(logvar.max(axis=-1)))
            store.create(name, jit, {"training": info, "threshold": jit.threshold})
    finally:
        store.close()


# ------------------------------------------------------------------------------ bodies
def good_x(n=3):
    return {"to": "x", "incoming": {
        "x": {"family": "gaussian", "mean": [0.0, 2.0, -1.0][:n], "var": [1.0, 0.5, 2.0][:n]},
        "z": {"family": "beta", "alpha": [2.0, 1.0, 2.0][:n], "beta": [1.0, 2.0, 1.0][:n]}}}


def honest_obs(n=3, seed=0):
    from kjit.factors import Logistic
    from kjit.oracles import QuadratureOracle
    from kjit.training import DEFAULT_DISTRIBUTIONS

    inc = DEFAULT_DISTRIBUTIONS["logistic"](n, np.random.default_rng(seed))
    q = QuadratureOracle(Logistic()).belief(inc, "x")
    return {"incoming": {v: {"family": type(m).__name__.lower(), **m.to_dict()} for v, m in inc.items()},
            "beliefs": {"family": "gaussian", **q.to_dict()}}


def text_with(body: dict, path: list, token: str) -> bytes:
    """JSON of ``body`` with the value at ``path`` replaced by the raw ``token``."""
    b = copy.deepcopy(body)
    node = b
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = "@@TOKEN@@"
    return json.dumps(b).replace('"@@TOKEN@@"', token).encode()


def kinds(quick: bool):
    """(name, method, url, content bytes, headers, expected status set, expected loc prefix or None,
    operator whose state is watched, poisoning?)"""
    out = []
    msg_url = "/v1/operators/logistic-x/messages?mode={}"
    obs_url = "/v1/operators/logistic-x/observations"
    # every parameter of every message, in predict mode: each bad value
    params = [("x", "mean"), ("x", "var"), ("z", "alpha"), ("z", "beta")]
    values = [("nan", "NaN"), ("inf", "Infinity"), ("neg_inf", "-Infinity"), ("overflow", "1e400"),
              ("huge", "1e308"), ("neg_huge", "-1e308"), ("beyond_range", "1e101"), ("string", '"1.5"'),
              ("bool", "true"), ("null", "null"), ("object", "{}")]
    for v, p in params:
        vals = values + ([("zero", "0"), ("negative", "-1"), ("tiny", "1e-300")] if p != "mean" else [])
        for vname, tok in vals:
            out.append((f"predict_{v}_{p}_{vname}", "POST", msg_url.format("predict"),
                        text_with(good_x(1), ["incoming", v, p, 0], tok), JSON, {422},
                        ["body", "incoming", v, p, 0], "logistic-x", False))
    # the finite extremes in each mode
    for mode in ("predict", "jit", "oracle"):
        out.append((f"{mode}_mean_1e308", "POST", msg_url.format(mode),
                    text_with(good_x(1), ["incoming", "x", "mean", 0], "1e308"), {**JSON, **AUTH}, {422},
                    ["body", "incoming", "x", "mean", 0], "logistic-x", False))
        out.append((f"{mode}_oracle_cannot_carry_1e60_mean", "POST", msg_url.format(mode),
                    json.dumps({"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [1e60], "var": [1e-60]},
                                                        "z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}}).encode(),
                    {**JSON, **AUTH}, {200, 422}, ["body", "incoming"], "logistic-x", False))
    # structure
    g = good_x()
    def mut(f):
        b = copy.deepcopy(g)
        f(b)
        return json.dumps(b).encode()
    structural = [
        ("missing_to", mut(lambda b: b.pop("to")), ["body", "to"]),
        ("unknown_recipient", mut(lambda b: b.update(to="y")), ["body", "to"]),
        ("wrong_recipient", mut(lambda b: b.update(to="z")), ["body", "to"]),
        ("unknown_variable", mut(lambda b: b["incoming"].update(w=b["incoming"]["x"])), ["body", "incoming", "w"]),
        ("missing_variable", mut(lambda b: b["incoming"].pop("z")), ["body", "incoming", "z"]),
        ("wrong_family", mut(lambda b: b["incoming"]["x"].update(family="beta")), ["body", "incoming", "x"]),
        ("unknown_family", mut(lambda b: b["incoming"]["x"].update(family="cauchy")), ["body", "incoming", "x"]),
        ("length_mismatch_params", mut(lambda b: b["incoming"]["x"]["var"].pop()), ["body", "incoming", "x"]),
        ("length_mismatch_vars", mut(lambda b: b["incoming"]["z"]["beta"].pop() or b["incoming"]["z"]["alpha"].pop()),
         ["body", "incoming"]),
        ("empty_lists", mut(lambda b: b["incoming"]["x"].update(mean=[], var=[])), ["body", "incoming", "x"]),
        ("extra_field", mut(lambda b: b.update(extra=1)), ["body", "extra"]),
        ("incoming_not_object", mut(lambda b: b.update(incoming=[1, 2])), ["body", "incoming"]),
        ("scalar_not_list", mut(lambda b: b["incoming"]["x"].update(mean=0.0)), ["body", "incoming", "x", "mean"]),
        ("nested_lists", mut(lambda b: b["incoming"]["x"].update(mean=[[0.0], [1.0], [2.0]])),
         ["body", "incoming", "x", "mean", 0]),
        ("too_many_rows", json.dumps(good_x(1) | {"incoming": {
            "x": {"family": "gaussian", "mean": [0.0] * 10_001, "var": [1.0] * 10_001},
            "z": {"family": "beta", "alpha": [2.0] * 10_001, "beta": [1.0] * 10_001}}}).encode(), ["body", "incoming"]),
        ("truncated_json", b'{"to": "x", "incoming": {"x": ', ["body"]),
        ("empty_body", b"", ["body"]),
        ("array_body", b"[1, 2, 3]", ["body"]),
        ("non_utf8", b'{"to": "x\xff\xfe"}', ["body"]),
        ("deep_nesting", b"[" * 100_000 + b"]" * 100_000, ["body"]),
        ("huge_integer", text_with(good_x(1), ["incoming", "x", "mean", 0], "9" * 5000), ["body"]),
        ("string_bomb", b'{"to": "' + b"x" * 5_000_000 + b'"}', ["body"]),
        ("many_keys", ("{" + ",".join(f'"k{i}": {i}' for i in range(100_000)) + "}").encode(), ["body"]),
        ("long_list_of_bad_numbers", text_with(good_x(1), ["incoming", "x", "mean"], "[" + ",".join(['"a"'] * 20_000)
                                               + "]"), ["body"]),
    ]
    for name, content, loc in structural:
        out.append((name, "POST", msg_url.format("predict"), content, JSON, {422}, loc, "logistic-x", False))
    big = b'{"to": "x", "incoming": {"x": {"family": "gaussian", "mean": ['
    big += b'"a",' * ((16 * 1024 * 1024 - len(big) - 200) // 4) + b'0]}}}'
    out.append(("body_16MiB_invalid_numbers", "POST", msg_url.format("predict"), big, JSON, {422}, ["body"],
                "logistic-x", False))
    out.append(("body_over_limit", "POST", msg_url.format("predict"), b" " * (16 * 1024 * 1024 + 10), JSON, {413},
                ["body"], "logistic-x", False))
    # query, path, auth
    out += [
        ("bad_mode", "POST", msg_url.format("sideways"), json.dumps(good_x()).encode(), {**JSON, **AUTH}, {422},
         ["query", "mode"], "logistic-x", False),
        ("unknown_operator", "POST", "/v1/operators/nope/messages?mode=predict", json.dumps(good_x()).encode(), JSON,
         {404}, ["path", "name"], "logistic-x", False),
        ("path_traversal_name", "POST", "/v1/operators/..%2F..%2Fetc/messages?mode=predict",
         json.dumps(good_x()).encode(), JSON, {404}, None, "logistic-x", False),
        ("jit_without_token", "POST", msg_url.format("jit"), json.dumps(good_x()).encode(), JSON, {401},
         ["header", "authorization"], "logistic-x", False),
        ("oracle_without_token", "POST", msg_url.format("oracle"), json.dumps(good_x()).encode(), JSON, {401},
         ["header", "authorization"], "logistic-x", False),
        ("wrong_token", "POST", obs_url, json.dumps(honest_obs()).encode(), {**JSON, "Authorization": "Bearer x"},
         {401}, ["header", "authorization"], "logistic-x", False),
        ("basic_auth_scheme", "POST", obs_url, json.dumps(honest_obs()).encode(),
         {**JSON, "Authorization": "Basic " + TOKEN}, {401}, ["header", "authorization"], "logistic-x", False),
        ("oracle_batch_too_big", "POST", msg_url.format("oracle"), json.dumps({"to": "x", "incoming": {
            "x": {"family": "gaussian", "mean": [0.0] * 5000, "var": [1.0] * 5000},
            "z": {"family": "beta", "alpha": [2.0] * 5000, "beta": [1.0] * 5000}}}).encode(), {**JSON, **AUTH}, {422},
         ["body", "incoming"], "logistic-x", False),
        ("idempotency_key_too_long", "POST", obs_url, json.dumps(honest_obs()).encode(),
         {**JSON, **AUTH, "Idempotency-Key": "k" * 500}, {422}, ["header"], "logistic-x", False),
    ]
    # observations: malformed and poisoned (all with the token)
    h = {**JSON, **AUTH}
    o = honest_obs(3, seed=1)
    def omut(f):
        b = copy.deepcopy(o)
        f(b)
        return json.dumps(b).encode()
    poisoned = [
        ("poison_mean_1e300", omut(lambda b: b["beliefs"]["mean"].__setitem__(1, 1e300)), ["body", "beliefs"]),
        ("poison_mean_1e90", omut(lambda b: b["beliefs"]["mean"].__setitem__(1, 1e90)), ["body", "beliefs", 1]),
        ("poison_mean_1e6", omut(lambda b: b["beliefs"]["mean"].__setitem__(0, 1e6)), ["body", "beliefs", 0]),
        ("poison_shift_40_sd", omut(lambda b: b["beliefs"]["mean"].__setitem__(
            2, b["incoming"]["x"]["mean"][2] + 40 * b["incoming"]["x"]["var"][2] ** 0.5)), ["body", "beliefs", 2]),
        ("poison_var_1e-90", omut(lambda b: b["beliefs"]["var"].__setitem__(0, 1e-90)), ["body", "beliefs", 0]),
        ("poison_var_1e90", omut(lambda b: b["beliefs"]["var"].__setitem__(0, 1e90)), ["body", "beliefs", 0]),
        ("poison_var_x1e6", omut(lambda b: b["beliefs"]["var"].__setitem__(1, b["incoming"]["x"]["var"][1] * 1e6)),
         ["body", "beliefs", 1]),
        ("poison_var_negative", omut(lambda b: b["beliefs"]["var"].__setitem__(0, -1.0)), ["body", "beliefs", "var", 0]),
        ("poison_mean_nan", text_with(o, ["beliefs", "mean", 0], "NaN"), ["body", "beliefs", "mean", 0]),
        ("poison_incoming_1e308", omut(lambda b: b["incoming"]["x"]["mean"].__setitem__(0, 1e308)),
         ["body", "incoming", "x", "mean", 0]),
    ]
    for name, content, loc in poisoned:
        out.append((name, "POST", obs_url, content, h, {422}, loc, "logistic-x", True))
    obs_bad = [
        ("obs_beliefs_wrong_family", omut(lambda b: b.update(beliefs={"family": "beta", "alpha": [1.0] * 3,
                                                                      "beta": [1.0] * 3})), ["body", "beliefs"]),
        ("obs_beliefs_too_few", omut(lambda b: (b["beliefs"]["mean"].pop(), b["beliefs"]["var"].pop())),
         ["body", "beliefs"]),
        ("obs_missing_beliefs", omut(lambda b: b.pop("beliefs")), ["body", "beliefs"]),
        ("obs_string_number", text_with(o, ["beliefs", "var", 0], '"0.5"'), ["body", "beliefs", "var", 0]),
    ]
    for name, content, loc in obs_bad:
        out.append((name, "POST", obs_url, content, h, {422}, loc, "logistic-x", False))
    # compound gamma messages
    cg = {"to": "tau", "incoming": {"tau": {"family": "gamma", "shape": [2.0], "rate": [1.0]}}}
    for p in ("shape", "rate"):
        for vname, tok in (("zero", "0"), ("huge", "1e300"), ("tiny", "1e-300"), ("nan", "NaN")):
            out.append((f"gamma_{p}_{vname}", "POST", "/v1/operators/compound_gamma-tau/messages?mode=jit",
                        text_with(cg, ["incoming", "tau", p, 0], tok), h, {422}, ["body", "incoming", "tau", p, 0],
                        "compound_gamma-tau", False))
    # training jobs (state: the operator list / job list are watched through the "jobs" target)
    job = {"name": "hostile-job", "factor": "logistic", "to": "x", "source": {"kind": "oracle", "n": 40},
           "n_inner": 10, "n_outer": 20}
    def jmut(f):
        b = copy.deepcopy(job)
        f(b)
        return json.dumps(b).encode()
    for name, content, loc in [
        ("job_n_too_large", jmut(lambda b: b["source"].update(n=150_000)), ["body", "source", "n"]),
        ("job_n_outer_too_large", jmut(lambda b: b.update(n_outer=5000)), ["body", "n_outer"]),
        ("job_n_inner_too_large", jmut(lambda b: b.update(n_inner=5000)), ["body", "n_inner"]),
        ("job_is_particles_too_many", jmut(lambda b: b["source"].update(oracle="importance_sampling",
                                                                        n_samples=5_000_000)),
         ["body", "source", "n_samples"]),
        ("job_path_traversal", jmut(lambda b: b.update(source={"kind": "file", "path": "../../../etc/passwd"})),
         ["body", "source", "path"]),
        ("job_absolute_path", jmut(lambda b: b.update(source={"kind": "file", "path": "/etc/passwd"})),
         ["body", "source", "path"]),
        ("job_missing_file", jmut(lambda b: b.update(source={"kind": "file", "path": "nope.npz"})),
         ["body", "source", "path"]),
        ("job_bad_name", jmut(lambda b: b.update(name="../x")), ["body", "name"]),
        ("job_unknown_factor", jmut(lambda b: b.update(factor="nope")), ["body", "factor"]),
        ("job_threshold_string", jmut(lambda b: b.update(threshold="1")), ["body", "threshold"]),
        ("job_n_bool", jmut(lambda b: b["source"].update(n=True)), ["body", "source", "n"]),
        ("job_name_taken", jmut(lambda b: b.update(name="logistic-x")), ["body", "name"]),
    ]:
        out.append((name, "POST", "/v1/operators", content, h, {409, 422}, loc, "jobs", False))
    return out


# ------------------------------------------------------------------------------ state
PROBE = {"x": good_x(), "z": good_x() | {"to": "z"},
         "tau": {"to": "tau", "incoming": {"tau": {"family": "gamma", "shape": [2.0, 5.0], "rate": [1.0, 0.3]}}}}


def fingerprint(c: httpx.Client, target: str):
    if target == "jobs":
        ops = c.get("/v1/operators").json()
        return ([(o["name"], o["version"]) for o in ops["operators"]],
                sorted(j["operator"] for j in c.get("/v1/jobs").json()["jobs"]))
    d = c.get(f"/v1/operators/{target}").json()
    r = c.post(f"/v1/operators/{target}/messages?mode=predict", json=PROBE[d["to"]]).json()
    return ({k: d[k] for k in ("version", "n_train", "counters", "updates")}, r["beliefs"], r["log_var"])


def names(resp: httpx.Response, loc) -> bool:
    if loc is None:
        return True
    try:
        items = resp.json()["detail"]
    except Exception:  # noqa: BLE001
        return False
    return any(list(i.get("loc", []))[:len(loc)] == loc for i in items)


def run_kinds(url: str, quick: bool, emit, sampler: RssSampler | None = None) -> dict:
    res = {"kinds": 0, "passed": 0, "server_errors": 0, "state_changed_on_reject": 0, "poisoning_accepted": 0,
           "health_max_ms": 0.0}
    with httpx.Client(base_url=url, timeout=120) as c:
        for name, method, path, content, headers, expect, loc, target, poison in kinds(quick):
            before = fingerprint(c, target)
            health = {"max": 0.0}
            stop = threading.Event()
            watcher = None
            if name == "body_16MiB_invalid_numbers":
                def poll():
                    with httpx.Client(base_url=url, timeout=60) as hc:
                        while True:  # at least once, then until the request is answered
                            t = time.perf_counter()
                            hc.get("/health")
                            health["max"] = max(health["max"], time.perf_counter() - t)
                            if stop.is_set():
                                break
                            time.sleep(0.01)
                watcher = threading.Thread(target=poll, daemon=True)
                watcher.start()
            try:
                r = c.request(method, path, content=content, headers=headers)
                status = r.status_code
            except httpx.HTTPError as exc:
                r, status = None, f"connection error: {type(exc).__name__}"
            finally:
                stop.set()
                if watcher is not None:
                    watcher.join()
                    res["health_max_ms"] = round(health["max"] * 1e3, 1)
            after = fingerprint(c, target)
            changed = before != after
            server_error = not isinstance(status, int) or status >= 500
            named = r is not None and (status < 300 or names(r, loc))
            accepted = isinstance(status, int) and status < 300  # (a jit answer may learn: not a reject)
            ok = (isinstance(status, int) and status in expect and not server_error and named
                  and (accepted or not changed)
                  and (r is None or ("Traceback" not in r.text and "/tmp/" not in r.text)))
            res["kinds"] += 1
            res["passed"] += ok
            res["server_errors"] += server_error
            res["state_changed_on_reject"] += changed and not (isinstance(status, int) and status < 300)
            res["poisoning_accepted"] += poison and isinstance(status, int) and status < 300
            line = {"kind": name, "status": status, "names_field": named, "state_changed": changed, "passed": ok}
            if sampler is not None:
                line["server_rss_peak_so_far_mb"] = round(sampler.peak / 2**20, 1)
            if not ok and r is not None:
                line["detail"] = r.text[:300]
            emit(line)
        # control kinds: an honest observation is accepted, its canonical re-serialisation is a duplicate
        body = honest_obs(3, seed=2)
        hdr = {**JSON, **AUTH, "Idempotency-Key": "hostile-1"}
        before = fingerprint(c, "logistic-x")
        r1 = c.post("/v1/operators/logistic-x/observations", content=json.dumps(body).encode(), headers=hdr)
        mid = fingerprint(c, "logistic-x")
        r2 = c.post("/v1/operators/logistic-x/observations", content=json.dumps(body, indent=1, sort_keys=True).encode(),
                    headers=hdr)
        after = fingerprint(c, "logistic-x")
        ok = r1.status_code == 200 and before != mid and r2.status_code == 200 and r2.json()["duplicate"] and mid == after
        res["kinds"] += 1
        res["passed"] += ok
        emit({"kind": "control_honest_observation_then_reserialised_retry", "status": [r1.status_code, r2.status_code],
              "names_field": True, "state_changed": before != mid, "passed": ok})
        body["beliefs"]["mean"][0] += 0.01
        before = after
        r3 = c.post("/v1/operators/logistic-x/observations", json=body, headers=hdr)
        after = fingerprint(c, "logistic-x")
        ok = r3.status_code == 409 and names(r3, ["header", "Idempotency-Key"]) and before == after
        res["kinds"] += 1
        res["passed"] += ok
        res["state_changed_on_reject"] += before != after
        emit({"kind": "idempotency_key_reused_with_another_body", "status": r3.status_code,
              "names_field": names(r3, ["header", "Idempotency-Key"]), "state_changed": before != after, "passed": ok})
        # a flood of training jobs: at most KJIT_MAX_QUEUED_JOBS accepted, the rest 429 + Retry-After
        statuses, retry = [], None
        for i in range(12):
            r = c.post("/v1/operators", headers={**JSON, **AUTH}, json={
                "name": f"flood-{i}", "factor": "logistic", "to": "x", "source": {"kind": "oracle", "n": 200},
                "n_inner": 20, "n_outer": 40})
            statuses.append(r.status_code)
            if r.status_code == 429:
                retry = r.headers.get("Retry-After")
        accepted = statuses.count(202)
        # the first KJIT_MAX_QUEUED_JOBS (4) are queued, then 429s (a job that finished meanwhile frees a place)
        ok = statuses[:4] == [202] * 4 and 429 in statuses and retry is not None and set(statuses) <= {202, 429}
        res["kinds"] += 1
        res["passed"] += ok
        res["server_errors"] += sum(s >= 500 for s in statuses)
        emit({"kind": "training_queue_flood_12", "status": sorted(set(statuses)), "accepted": accepted,
              "names_field": True, "state_changed": accepted > 0, "passed": ok})
    return res


# ------------------------------------------------------------------------------ recovery
def restart_identical(store: Path, tmp: Path, sampler: RssSampler, n_records: int, emit) -> bool:
    from kjit.factors import Logistic
    from kjit.oracles import QuadratureOracle
    from kjit.training import DEFAULT_DISTRIBUTIONS

    rows = 5
    inc = DEFAULT_DISTRIBUTIONS["logistic"](n_records * rows, np.random.default_rng(21))
    q = QuadratureOracle(Logistic()).belief(inc, "x")
    probe = DEFAULT_DISTRIBUTIONS["logistic"](64, np.random.default_rng(22))
    probe_body = {"to": "x", "incoming": {v: {"family": type(m).__name__.lower(), **m.to_dict()} for v, m in probe.items()}}
    rng = np.random.default_rng(23)
    stops = sorted(rng.choice(np.arange(1, n_records), size=4, replace=False).tolist())
    how = {v: ("kill" if j % 2 == 0 else "stop") for j, v in enumerate(stops)}
    answers = []
    for label, plan in (("never", {}), ("restarted", how)):
        root = tmp / f"replay-{label}"
        shutil.copytree(store, root)
        (root / ".lock").unlink(missing_ok=True)
        srv = start_server(root, sampler)
        try:
            for i in range(n_records):
                if i in plan:
                    srv.kill() if plan[i] == "kill" else srv.stop()
                    srv = start_server(root, sampler)
                sl = slice(i * rows, (i + 1) * rows)
                body = {"incoming": {v: {"family": type(m).__name__.lower(), **m[sl].to_dict()} for v, m in inc.items()},
                        "beliefs": {"family": "gaussian", **q[sl].to_dict()}}
                r = httpx.post(srv.url + "/v1/operators/logistic-x/observations", json=body, headers=AUTH, timeout=60)
                if r.status_code != 200:
                    raise RuntimeError(f"record {i}: {r.status_code} {r.text[:300]}")
            answers.append(httpx.post(srv.url + "/v1/operators/logistic-x/messages?mode=predict", json=probe_body,
                                      timeout=60).json())
        finally:
            srv.kill()
    a, b = answers
    same = (a["version"] == b["version"] == n_records and a["beliefs"] == b["beliefs"] and a["log_var"] == b["log_var"])
    diff = float(np.max(np.abs(np.asarray(a["beliefs"]["mean"]) - np.asarray(b["beliefs"]["mean"]))))
    emit({"kind": "restart_bit_identical", "records": n_records, "rows_per_record": rows,
          "restarts": {str(k): v for k, v in how.items()}, "identical": same, "max_abs_mean_diff": diff,
          "versions": [a["version"], b["version"]], "beliefs_equal": a["beliefs"] == b["beliefs"],
          "log_var_equal": a["log_var"] == b["log_var"]})
    return same


# ------------------------------------------------------------------------------ largest job
def job_memory(tmp: Path, emit) -> None:
    from service.settings import Settings

    s = Settings()
    sampler = RssSampler(period=0.05).start()
    root = tmp / "job-store"
    srv = start_server(root, sampler, {"KJIT_SNAPSHOT_EVERY": "500"})
    try:
        time.sleep(1.0)
        base = psutil.Process(srv.proc.pid).memory_info().rss
        sampler.peak = base
        t = time.perf_counter()
        r = httpx.post(srv.url + "/v1/operators", headers=AUTH, timeout=60, json={
            "name": "largest", "factor": "logistic", "to": "x", "source": {"kind": "oracle", "n": s.max_train_n},
            "n_inner": s.max_n_inner, "n_outer": s.max_n_outer})
        r.raise_for_status()
        loc = r.headers["Location"]
        while True:
            j = httpx.get(srv.url + loc, timeout=60).json()
            if j["status"] in ("succeeded", "failed"):
                break
            time.sleep(1.0)
        emit({"kind": "largest_job", "n": s.max_train_n, "n_inner": s.max_n_inner, "n_outer": s.max_n_outer,
              "status": j["status"], "error": j.get("error"), "seconds": round(time.perf_counter() - t, 1),
              "baseline_rss_mb": round(base / 2**20, 1), "peak_rss_mb": round(sampler.peak / 2**20, 1)})
    finally:
        srv.kill()
        sampler.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true", help="small operators, fewer recovery records")
    ap.add_argument("--records", type=int, default=None, help="observation records of the recovery check")
    ap.add_argument("--job-memory", action="store_true", help="only measure the largest allowed training job")
    args = ap.parse_args(argv)

    def emit(d):
        print(json.dumps(d), flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="kjit-hostile-"))
    try:
        if args.job_memory:
            job_memory(tmp, emit)
            return 0
        store = tmp / "pristine"
        build_store(store, args.quick)
        sampler = RssSampler().start()
        work = tmp / "store"
        shutil.copytree(store, work)
        srv = start_server(work, sampler)
        try:
            res = run_kinds(srv.url, args.quick, emit, sampler)
        finally:
            srv.stop()
        n_records = args.records or (230 if args.quick else 460)
        res["restart_bit_identical"] = restart_identical(store, tmp, sampler, n_records, emit)
        sampler.stop()
        res["max_server_rss_mb"] = round(sampler.peak / 2**20, 1)
        summary = {k: res[k] for k in ("kinds", "passed", "server_errors", "state_changed_on_reject",
                                       "poisoning_accepted", "restart_bit_identical", "max_server_rss_mb")}
        emit({"kind": "health_during_16MiB_body", "health_max_ms": res["health_max_ms"]})
        emit(summary)
        if not args.quick:
            job_memory(tmp, emit)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
