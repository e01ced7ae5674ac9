"""The HTTP service: through a real uvicorn server on a loopback port (health, messages in the
three modes, observations, training jobs, metrics, concurrency) and, for the many validation
cases, through the in-process test client — every bad input gets a 4xx naming the field and
leaves the operator's state exactly as it was."""

from __future__ import annotations

import copy
import json
import threading
import time

import httpx
import numpy as np
import pytest

from kjit.factors import Logistic
from kjit.families import Beta, Gaussian
from kjit.oracles import QuadratureOracle
from kjit.training import make_training_set

from test_service_fixtures import (  # noqa: F401 - fixtures
    TOKEN,
    app_client,
    live,
    load_pristine,
    pristine_store,
    probe,
    settings_for,
    store_dir,
    wait_job,
)
from service.testing import ThreadedServer

AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")


def body(incoming, to):
    return {"to": to, "incoming": {v: {"family": type(m).__name__.lower(), **m.to_dict()} for v, m in incoming.items()}}


def beliefs_body(q):
    return {"family": type(q).__name__.lower(), **q.to_dict()}


def as_gaussian(d):
    return Gaussian(d["mean"], d["var"])


# ------------------------------------------------------------------------------ real server
def test_health_ready_and_listing(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"
        r = c.get("/ready")
        assert r.status_code == 200
        assert r.json() == {"ready": True, "operators": ["compound_gamma-tau", "logistic-x", "logistic-z"],
                            "loading": [], "failed": {}}
        ops = {o["name"]: o for o in c.get("/v1/operators").json()["operators"]}
        assert ops["logistic-x"]["families"] == {"x": "gaussian", "z": "beta"}
        assert ops["logistic-x"]["to"] == "x" and ops["logistic-z"]["to"] == "z"
        d = c.get("/v1/operators/logistic-x").json()
        for key in ("factor", "to", "families", "features", "hyperparameters", "threshold", "counters", "version",
                    "n_train", "updates", "limits", "training"):
            assert key in d, key
        assert d["features"] == {"n_inner": 50, "n_outer": 100, "treatment": "unconstrained", "target": "relative"}
        assert d["n_train"] == 300 and d["version"] == 0
        assert c.get("/docs").status_code == 200
        spec = c.get("/openapi.json").json()
        assert "/v1/operators/{name}/messages" in spec["paths"]
        # every key of the detail is documented by its schema (audit and threshold_note were not)
        documented = spec["components"]["schemas"]["OperatorDetail"]["properties"]
        assert set(d) <= set(documented), set(d) - set(documented)
        assert isinstance(d["audit"], dict) and d["audit"]["enabled"] is False and d["audit"]["server"] is None
        assert d["threshold_note"] is None
        assert d["decision_weighting"] == "range+density"  # (an operator fitted now keeps both)
        assert {"audit", "threshold_note"} <= set(documented) - set(
            spec["components"]["schemas"]["OperatorDetail"].get("required", []))


@pytest.mark.parametrize("token", [None, TOKEN])
def test_openapi_lists_401_only_where_a_token_can_be_needed(token):
    """No token configured: nothing answers 401, so no operation documents it (nor any security);
    with one, exactly the operations the token guards (service.middleware.is_mutating)."""
    from service import create_app

    spec = create_app(settings_for("/nonexistent", token=token)).openapi()
    with_401 = {(m.upper(), p) for p, ops in spec["paths"].items() for m, op in ops.items()
                if "401" in op.get("responses", {})}
    secured = {(m.upper(), p) for p, ops in spec["paths"].items() for m, op in ops.items() if op.get("security")}
    if token is None:
        assert with_401 == set() and secured == set()
        assert "HTTPBearer" not in spec.get("components", {}).get("securitySchemes", {})
    else:
        assert with_401 == secured == {("POST", "/v1/operators"), ("POST", "/v1/operators/{name}/messages"),
                                       ("POST", "/v1/operators/{name}/observations"),
                                       ("POST", "/v1/operators/{name}/merge")}


def test_messages_three_modes_match_the_library(live, store_dir, pristine_store):
    local = load_pristine(pristine_store, "logistic-x")
    inc = probe("logistic", 40)
    oracle = QuadratureOracle(local.factor)
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        # predict: exactly the learned operator, never the oracle, read-only
        r = c.post("/v1/operators/logistic-x/messages", params={"mode": "predict"}, json=body(inc, "x")).json()
        q_loc, lv_loc = local.operator.predict(inc)
        np.testing.assert_array_equal(r["beliefs"]["mean"], q_loc.mean())
        np.testing.assert_array_equal(r["beliefs"]["var"], q_loc.var())
        # the log variance the JIT rule compares (weighted: Family.decision_weights), as the library's
        np.testing.assert_array_equal(np.transpose(r["log_var"]), local.screen_certified(inc)[1].log_var)
        assert r["coords"] == ["mean", "log_var"]
        m_loc = q_loc / inc["x"]
        np.testing.assert_array_equal(np.transpose(r["messages"]["natural"]), m_loc.natural())
        assert r["messages"]["is_proper"] == m_loc.is_proper.tolist()
        assert r["consulted"] == [False] * 40 and r["version"] == 0 and r["n_consulted"] == 0
        # oracle: the quadrature oracle on every row, nothing learned
        r = c.post("/v1/operators/logistic-x/messages", params={"mode": "oracle"}, json=body(inc, "x")).json()
        q_or = oracle.belief(inc, "x")
        np.testing.assert_array_equal(r["beliefs"]["mean"], q_or.mean())
        assert r["log_var"] is None and all(r["consulted"]) and r["version"] == 0
        # jit: uncertain rows from the oracle (and learned), the rest predicted — as the local JITOperator does
        r = c.post("/v1/operators/logistic-x/messages", params={"mode": "jit"}, json=body(inc, "x")).json()
        q_jit, lv_jit, cons = local.predict(inc)
        assert r["consulted"] == cons.tolist()
        assert 0 < r["n_consulted"] < 40
        np.testing.assert_array_equal(r["beliefs"]["mean"], q_jit.mean())
        np.testing.assert_array_equal(np.transpose(r["log_var"]), lv_jit)
        assert r["version"] == 1  # one durable update record
        d = c.get("/v1/operators/logistic-x").json()
        # the consulted rows are learned but for those below the density guard (answered, not learned)
        sparse = local.outside_rows(inc)
        n_learned = r["n_consulted"] - int(sparse.sum())
        assert cons[sparse].all() and d["n_train"] == 300 + n_learned == local.operator.n_train_
        assert d["counters"]["consultations"] == r["n_consulted"] and d["updates"]["learned_pairs"] == n_learned
        assert d["density_guard"] == {"value": local.density_guard, "pairs": 300.0}
        # the learned pairs changed the predictions exactly as they changed the local operator
        r2 = c.post("/v1/operators/logistic-x/messages", params={"mode": "predict"}, json=body(inc, "x")).json()
        np.testing.assert_array_equal(r2["beliefs"]["mean"], local.operator.predict(inc)[0].mean())


def test_observations_update_the_operator(live, store_dir, pristine_store):
    local = load_pristine(pristine_store, "logistic-x")
    rng = np.random.default_rng(5)
    inc = probe("logistic", 12, seed=99)
    q = QuadratureOracle(local.factor).belief(inc, "x")
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/operators/logistic-x/observations", json={"incoming": body(inc, "x")["incoming"],
                                                                   "beliefs": beliefs_body(q)})
        assert r.status_code == 200, r.text
        assert not local.outside_rows(inc).any()  # (none below the density guard: all learned)
        assert r.json() == {"operator": "logistic-x", "accepted": 12, "not_learned": 0, "version": 1, "n_train": 312,
                            "duplicate": False}
        local.operator.partial_fit(inc, q)
        test = probe("logistic", 30, seed=int(rng.integers(1000)))
        got = c.post("/v1/operators/logistic-x/messages?mode=predict", json=body(test, "x")).json()
        np.testing.assert_array_equal(got["beliefs"]["mean"], local.operator.belief(test).mean())
        # idempotent retries: the same key and body add nothing
        hdr = {"Idempotency-Key": "k-1"}
        payload = {"incoming": body({k: v[:2] for k, v in inc.items()}, "x")["incoming"],
                   "beliefs": beliefs_body(q[:2])}
        a = c.post("/v1/operators/logistic-x/observations", json=payload, headers=hdr).json()
        b = c.post("/v1/operators/logistic-x/observations", json=payload, headers=hdr).json()
        assert a["version"] == b["version"] == 2 and not a["duplicate"] and b["duplicate"]
        payload2 = copy.deepcopy(payload)
        payload2["beliefs"]["mean"][0] += 1e-6  # a different body that is still a plausible belief
        conflict = c.post("/v1/operators/logistic-x/observations", json=payload2, headers=hdr)
        assert conflict.status_code == 409 and conflict.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
        assert c.get("/v1/operators/logistic-x").json()["version"] == 2


def test_observation_answer_names_the_pairs_at_its_version(app_client, monkeypatch):
    """An observation's ``n_train`` is the operator's at the answer's ``version``: it was read again
    after the update, under another lock, so another request's update landing in between showed in it
    (found by an audit: 115 of 160 answers under four concurrent writers).  The other update is made
    to land there; a duplicate answers its first request's count."""
    from service.store.entry import Entry

    inc = probe("logistic", 7, seed=41)
    q = QuadratureOracle(Logistic()).belief(inc, "x")
    first, other = ({v: m[:4] for v, m in inc.items()}, q[:4]), ({v: m[4:] for v, m in inc.items()}, q[4:])
    real = Entry.observe
    pending = [other]

    def observe(self, incoming, beliefs, key, body_hash):
        out = real(self, incoming, beliefs, key, body_hash)
        while pending:  # another request's update, applied before this one's answer is formed
            real(self, *pending.pop(), None, None)
        return out

    monkeypatch.setattr(Entry, "observe", observe)
    n0 = app_client.get("/v1/operators/logistic-x").json()["n_train"]
    payload = {"incoming": body(first[0], "x")["incoming"], "beliefs": beliefs_body(first[1])}
    hdr = {**AUTH, "Idempotency-Key": "k-count"}
    r = app_client.post("/v1/operators/logistic-x/observations", json=payload, headers=hdr)
    assert r.status_code == 200, r.text
    assert (r.json()["version"], r.json()["n_train"]) == (1, n0 + 4)
    now = app_client.get("/v1/operators/logistic-x").json()
    assert (now["version"], now["n_train"]) == (2, n0 + 7)
    again = app_client.post("/v1/operators/logistic-x/observations", json=payload, headers=hdr).json()
    assert again["duplicate"] and (again["version"], again["n_train"]) == (1, n0 + 4)


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_idempotency_key_is_refused_and_changes_nothing(app_client, key):
    """An empty (or blank) Idempotency-Key was taken as a key and never remembered: each retry applied again, and
    another body under it was no 409 (found by an audit).  Now a 422 naming the header; nothing learned."""
    inc = probe("logistic", 3, seed=8)
    q = QuadratureOracle(Logistic()).belief(inc, "x")
    payload = {"incoming": body(inc, "x")["incoming"], "beliefs": beliefs_body(q)}
    before = app_client.get("/v1/operators/logistic-x").json()
    r = app_client.post("/v1/operators/logistic-x/observations", json=payload, headers={**AUTH, "Idempotency-Key": key})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"], r.text
    after = app_client.get("/v1/operators/logistic-x").json()
    assert (after["version"], after["n_train"]) == (before["version"], before["n_train"])


def test_a_prediction_that_is_no_belief_is_refused_by_row(app_client, monkeypatch):
    """A row whose learned prediction overflows its family (kjit.operators.PredictionOverflowError) is
    a 422 naming that row — as an oracle's failure is — so a client skips just it; it was a 422 for
    the batch, rows unnamed."""
    from kjit.operators import KernelOperator

    real = KernelOperator._finish_coords

    def far(self, z, v, psi, flat, *a, **k):
        out = real(self, z, v, psi, flat, *a, **k)
        coords = out[0] if v is not None else out
        coords.reshape(-1, coords.shape[-1])[np.asarray(flat["x"].mean()).reshape(-1) == 1.0, 1] += 800.0
        return out

    monkeypatch.setattr(KernelOperator, "_finish_coords", far)
    inc = {"x": Gaussian([0.0, 1.0, -1.0], [1.0, 0.5, 2.0]), "z": Beta([2.0, 1.0, 3.0], [1.0, 2.0, 3.0])}
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=body(inc, "x"))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert [d["loc"] for d in detail] == [["body", "incoming", 1]] and detail[0]["type"] == "not_computable"
    assert "rows [1]" in detail[0]["msg"]


def test_training_job_with_progress(live, store_dir):
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        req = {"name": "tiny-x", "factor": "logistic", "to": "x", "n_inner": 20, "n_outer": 30, "threshold": -3.0,
               "source": {"kind": "oracle", "n": 80}}
        r = c.post("/v1/operators", json=req)
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["status"] in ("queued", "running", "succeeded") and job["operator"] == "tiny-x"
        loc = r.headers["Location"]
        seen = set()
        job = wait_job(c, loc, on_each=lambda j: seen.add(j["progress"]["stage"]))
        assert job["status"] == "succeeded", job
        assert job["progress"]["fraction"] == 1.0 and job["result"]["n_train"] == 80
        d = c.get("/v1/operators/tiny-x").json()
        assert d["n_train"] == 80 and d["threshold"] == -3.0 and d["features"]["n_outer"] == 30
        inc = probe("logistic", 5)
        m = c.post("/v1/operators/tiny-x/messages?mode=predict", json=body(inc, "x"))
        assert m.status_code == 200 and m.json()["n"] == 5
        # from a training-set file in <store>/training-sets
        ts = make_training_set("logistic", "z", probe("logistic", 60, seed=3), QuadratureOracle(Logistic()))
        ts.save(store_dir / "training-sets" / "z60.npz")
        r = c.post("/v1/operators", json={"name": "tiny-z", "factor": "logistic", "to": "z", "n_inner": 20,
                                          "n_outer": 30, "source": {"kind": "file", "path": "z60.npz"}})
        assert r.status_code == 202, r.text
        job = wait_job(c, r.headers["Location"])
        assert job["status"] == "succeeded", job
        names = [o["name"] for o in c.get("/v1/operators").json()["operators"]]
        assert {"tiny-x", "tiny-z"} <= set(names)
        assert len(c.get("/v1/jobs").json()["jobs"]) == 2


def test_a_job_whose_operator_cannot_predict_fails_and_installs_nothing(store_dir):
    """Found by an audit: the job was "failed" but its operator's directory stayed — the name taken
    (409), and after a restart /ready answered 503 until it was removed by hand."""
    ts = make_training_set("logistic", "z", probe("logistic", 60, seed=3), QuadratureOracle(Logistic()))
    ts.save(store_dir / "training-sets" / "z60.npz")
    data = dict(np.load(store_dir / "training-sets" / "z60.npz", allow_pickle=False))
    key = next(k for k in data if k.startswith("belief") and k.endswith("alpha"))
    data[key] = data[key] * 1e250  # finite, positive, and far beyond what a request may carry
    with open(store_dir / "training-sets" / "huge.npz", "wb") as fh:
        np.savez(fh, **data)
    req = {"name": "huge-z", "factor": "logistic", "to": "z", "n_inner": 20, "n_outer": 30,
           "source": {"kind": "file", "path": "huge.npz"}}
    with ThreadedServer(settings_for(store_dir)) as srv, httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        job = wait_job(c, c.post("/v1/operators", json=req).headers["Location"])
        assert job["status"] == "failed" and "cannot predict ordinary messages" in job["error"], job
        assert not (store_dir / "operators" / "huge-z").exists()
        assert c.get("/v1/operators/huge-z").status_code == 404
        # the name is free: a good source under it succeeds
        ok = wait_job(c, c.post("/v1/operators", json={**req, "source": {"kind": "file", "path": "z60.npz"}})
                      .headers["Location"])
        assert ok["status"] == "succeeded", ok
    with ThreadedServer(settings_for(store_dir)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/ready").status_code == 200


def test_job_records_survive_a_restart_and_interrupted_jobs_are_failed(store_dir):
    """A finished job is still answered after a restart (its record is in <store>/jobs); a job
    that a crash left running is reported failed ("interrupted") instead of running forever —
    unless the store had installed its operator, which is then what it did."""
    req = {"name": "tiny-x", "factor": "logistic", "to": "x", "n_inner": 20, "n_outer": 30, "threshold": -3.0,
           "source": {"kind": "oracle", "n": 60}}
    with ThreadedServer(settings_for(store_dir)) as srv, httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/operators", json=req)
        assert r.status_code == 202, r.text
        loc = r.headers["Location"]
        job = wait_job(c, loc)
        assert job["status"] == "succeeded", job
    # a record a crash left behind mid-job
    ghost = dict(job, id="0123456789abcdef", status="running", finished=None, result=None, operator="ghost")
    (store_dir / "jobs" / "0123456789abcdef.json").write_text(json.dumps(ghost))
    # ... and one stopped after the store installed its operator, before its record said so (found in
    # review: "failed (interrupted)" while the operator was served, and a retry got 409)
    late = dict(job, status="running", finished=None, result=None)
    (store_dir / "jobs" / f"{job['id']}.json").write_text(json.dumps(late))
    with ThreadedServer(settings_for(store_dir)) as srv, httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        again = c.get(loc).json()
        assert again["status"] == "succeeded" and again["error"] is None and again["result"] == job["result"]
        assert again["progress"]["fraction"] == 1.0
        g = c.get("/v1/jobs/0123456789abcdef").json()
        assert g["status"] == "failed" and "interrupted" in g["error"] and g["finished"]
        assert {j["id"] for j in c.get("/v1/jobs").json()["jobs"]} == {job["id"], "0123456789abcdef"}


def test_metrics_in_prometheus_format(live):
    inc = probe("logistic", 10)
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        for mode in ("predict", "predict", "jit"):
            c.post(f"/v1/operators/logistic-x/messages?mode={mode}", json=body(inc, "x")).raise_for_status()
        for path in ("draws/3", "draws/mean"):  # (counted as draws, not as mode=predict: found by an audit)
            c.post(f"/v1/operators/logistic-x/{path}/messages", json=body(inc, "x")).raise_for_status()
        c.get("/v1/operators/nope")
        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("kjit_messages_total", (("mode", "predict"), ("operator", "logistic-x")))] == 20
    assert samples[("kjit_messages_total", (("mode", "jit"), ("operator", "logistic-x")))] == 10
    assert samples[("kjit_messages_total", (("mode", "draw"), ("operator", "logistic-x")))] == 20
    assert samples[("kjit_http_requests_total", (("method", "POST"), ("route", "/v1/operators/{name}/messages"),
                                                 ("status", "200")))] == 3
    assert samples[("kjit_http_requests_total", (("method", "GET"), ("route", "/v1/operators/{name}"),
                                                 ("status", "404")))] == 1
    cons = samples.get(("kjit_consultations_total", (("operator", "logistic-x"),)), 0)
    assert cons > 0
    assert samples[("kjit_updates_total", (("operator", "logistic-x"), ("source", "jit")))] == cons
    assert samples[("kjit_operator_version", (("operator", "logistic-x"),))] == 1
    assert samples[("kjit_http_request_duration_seconds_count",
                    (("method", "POST"), ("route", "/v1/operators/{name}/messages")))] == 3
    assert ("kjit_store_seconds_count", (("op", "fsync"),)) in samples


def test_concurrent_predictions_never_see_half_applied_updates(live, store_dir, pristine_store):
    """Predictions run while another thread streams observations: every prediction must equal
    the operator at exactly the version it reports (replayed locally)."""
    local = load_pristine(pristine_store, "logistic-x")
    test = probe("logistic", 200, seed=11)
    batches = [probe("logistic", 3, seed=1000 + i) for i in range(15)]
    oracle = QuadratureOracle(local.factor)
    beliefs = [oracle.belief(b, "x") for b in batches]
    seen = []
    stop = threading.Event()

    def reader():
        with httpx.Client(base_url=live.url, timeout=60) as c:
            while not stop.is_set():
                r = c.post("/v1/operators/logistic-x/messages?mode=predict", json=body(test, "x")).json()
                seen.append((r["version"], np.array(r["beliefs"]["mean"]), np.array(r["beliefs"]["var"])))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        for b, q in zip(batches, beliefs):
            r = c.post("/v1/operators/logistic-x/observations", json={"incoming": body(b, "x")["incoming"],
                                                                       "beliefs": beliefs_body(q)})
            assert r.status_code == 200
            time.sleep(0.005)
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    expected = {0: local.operator.belief(test)}
    for v, (b, q) in enumerate(zip(batches, beliefs), start=1):
        local.operator.partial_fit(b, q)
        expected[v] = local.operator.belief(test)
    versions = {v for v, _, _ in seen}
    assert len(versions) >= 3, versions  # the readers did overlap the updates
    for v, mean, var in seen:
        np.testing.assert_array_equal(mean, expected[v].mean())
        np.testing.assert_array_equal(var, expected[v].var())


# ------------------------------------------------------------------------------ validation
def _good_x(n=3):
    return {"to": "x", "incoming": {
        "x": {"family": "gaussian", "mean": [0.0, 2.0, -1.0][:n], "var": [1.0, 0.5, 2.0][:n]},
        "z": {"family": "beta", "alpha": [2.0, 1.0, 2.0][:n], "beta": [1.0, 2.0, 1.0][:n]}}}


def _mut(f):
    b = _good_x()
    f(b)
    return b


def _raw(text):
    return {"content": text.encode(), "headers": {"Content-Type": "application/json", **AUTH}}


MSG = "/v1/operators/logistic-x/messages?mode=jit"
OBS = "/v1/operators/logistic-x/observations"
GOOD_OBS = {"incoming": _good_x()["incoming"], "beliefs": {"family": "gaussian", "mean": [0.1, 1.0, -0.5],
                                                           "var": [0.5, 0.3, 0.9]}}
GOOD_JSON = json.dumps(_good_x())


def _obs(f):
    b = copy.deepcopy(GOOD_OBS)
    f(b)
    return b


def _set(path, value):
    def f(b):
        node = b
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return f


CASES = [
    # id, method, url, request kwargs, status, expected loc (prefix of some error's loc)
    ("negative variance", "POST", MSG, {"json": _mut(_set(["incoming", "x", "var", 1], -1.0))}, 422,
     ["body", "incoming", "x", "var", 1]),
    ("zero variance", "POST", MSG, {"json": _mut(_set(["incoming", "x", "var", 0], 0.0))}, 422,
     ["body", "incoming", "x", "var", 0]),
    ("alpha zero", "POST", MSG, {"json": _mut(_set(["incoming", "z", "alpha", 0], 0.0))}, 422,
     ["body", "incoming", "z", "alpha", 0]),
    ("alpha negative", "POST", MSG, {"json": _mut(_set(["incoming", "z", "alpha", 2], -3.0))}, 422,
     ["body", "incoming", "z", "alpha", 2]),
    ("gamma shape zero", "POST", "/v1/operators/compound_gamma-tau/messages?mode=jit",
     {"json": {"to": "tau", "incoming": {"tau": {"family": "gamma", "shape": [0.0], "rate": [1.0]}}}}, 422,
     ["body", "incoming", "tau", "shape", 0]),
    ("NaN token", "POST", MSG, _raw(GOOD_JSON.replace("2.0", "NaN", 1)), 422, ["body", "incoming", "x", "mean", 1]),
    ("Infinity token", "POST", MSG, _raw(GOOD_JSON.replace("0.5", "Infinity", 1)), 422,
     ["body", "incoming", "x", "var", 1]),
    ("overflowing literal", "POST", MSG, _raw(GOOD_JSON.replace("-1.0", "-1e400", 1)), 422,
     ["body", "incoming", "x", "mean", 2]),
    ("empty batch", "POST", MSG, {"json": _mut(lambda b: b["incoming"].update(
        x={"family": "gaussian", "mean": [], "var": []}, z={"family": "beta", "alpha": [], "beta": []}))}, 422,
     ["body", "incoming", "x", "mean"]),
    ("oversized batch", "POST", MSG, {"json": {"to": "x", "incoming": {
        "x": {"family": "gaussian", "mean": [0.0] * 501, "var": [1.0] * 501},
        "z": {"family": "beta", "alpha": [2.0] * 501, "beta": [1.0] * 501}}}}, 422, ["body", "incoming", "x", "mean"]),
    ("unknown operator", "POST", "/v1/operators/nope/messages?mode=jit", {"json": _good_x()}, 404, ["path", "name"]),
    ("unknown recipient", "POST", MSG, {"json": _mut(_set(["to"], "q"))}, 422, ["body", "to"]),
    ("recipient of another operator", "POST", MSG, {"json": _mut(_set(["to"], "z"))}, 422, ["body", "to"]),
    ("missing recipient", "POST", MSG, {"json": _mut(lambda b: b.pop("to"))}, 422, ["body", "to"]),
    ("wrong family for a variable", "POST", MSG, {"json": _mut(_set(["incoming", "x"], {
        "family": "beta", "alpha": [1.0, 1.0, 1.0], "beta": [1.0, 1.0, 1.0]}))}, 422, ["body", "incoming", "x", "family"]),
    ("unknown family", "POST", MSG, {"json": _mut(_set(["incoming", "x", "family"], "cauchy"))}, 422,
     ["body", "incoming", "x"]),
    ("unknown variable", "POST", MSG, {"json": _mut(_set(["incoming", "w"], {
        "family": "gaussian", "mean": [0.0] * 3, "var": [1.0] * 3}))}, 422, ["body", "incoming", "w"]),
    ("missing variable", "POST", MSG, {"json": _mut(lambda b: b["incoming"].pop("z"))}, 422, ["body", "incoming", "z"]),
    ("parameter lengths differ", "POST", MSG, {"json": _mut(_set(["incoming", "x", "var"], [1.0, 2.0]))}, 422,
     ["body", "incoming", "x", "var"]),
    ("batch lengths differ", "POST", MSG, {"json": _mut(_set(["incoming", "z"], {
        "family": "beta", "alpha": [2.0], "beta": [1.0]}))}, 422, ["body", "incoming"]),
    ("misspelt parameter", "POST", MSG, {"json": _mut(lambda b: b["incoming"]["x"].update(sd=[1.0, 1.0, 1.0]))}, 422,
     ["body", "incoming", "x", "sd"]),
    ("string for a number", "POST", MSG, {"json": _mut(_set(["incoming", "x", "mean", 0], "zero"))}, 422,
     ["body", "incoming", "x", "mean", 0]),
    ("malformed JSON", "POST", MSG, _raw(GOOD_JSON[:-7]), 422, ["body"]),
    ("JSON not an object", "POST", MSG, _raw("[1, 2]"), 422, ["body"]),
    ("bad mode", "POST", "/v1/operators/logistic-x/messages?mode=fast", {"json": _good_x()}, 422, ["query", "mode"]),
    ("missing token", "POST", MSG, {"json": _good_x(), "headers": {"Authorization": ""}}, 401,
     ["header", "authorization"]),
    ("wrong token", "POST", MSG, {"json": _good_x(), "headers": {"Authorization": "Bearer nope"}}, 401,
     ["header", "authorization"]),
    ("body too large", "POST", MSG, _raw(json.dumps({"to": "x", "incoming": {
        "x": {"family": "gaussian", "mean": [0.123456789] * 120_000, "var": [1.0] * 120_000}}})), 413, ["body"]),
    # observations
    ("obs: negative belief variance", "POST", OBS, {"json": _obs(_set(["beliefs", "var", 2], -0.5))}, 422,
     ["body", "beliefs", "var", 2]),
    ("obs: belief of the wrong family", "POST", OBS, {"json": _obs(_set(["beliefs"], {
        "family": "beta", "alpha": [1.0] * 3, "beta": [1.0] * 3}))}, 422, ["body", "beliefs", "family"]),
    ("obs: fewer beliefs than rows", "POST", OBS, {"json": _obs(_set(["beliefs"], {
        "family": "gaussian", "mean": [0.0], "var": [1.0]}))}, 422, ["body", "beliefs", "mean"]),
    ("obs: alpha negative", "POST", OBS, {"json": _obs(_set(["incoming", "z", "alpha", 0], -1.0))}, 422,
     ["body", "incoming", "z", "alpha", 0]),
    ("obs: NaN", "POST", OBS, _raw(json.dumps(GOOD_OBS).replace("0.3", "NaN")), 422, ["body", "beliefs", "var", 1]),
    ("obs: empty batch", "POST", OBS, {"json": {"incoming": {"x": {"family": "gaussian", "mean": [], "var": []},
                                                             "z": {"family": "beta", "alpha": [], "beta": []}},
                                                "beliefs": {"family": "gaussian", "mean": [], "var": []}}}, 422,
     ["body", "incoming", "x", "mean"]),
    ("obs: missing token", "POST", OBS, {"json": GOOD_OBS, "headers": {"Authorization": ""}}, 401,
     ["header", "authorization"]),
    ("obs: unknown operator", "POST", "/v1/operators/nope/observations", {"json": GOOD_OBS}, 404, ["path", "name"]),
    # training
    ("train: unknown factor", "POST", "/v1/operators", {"json": {"name": "a", "factor": "nope", "to": "x",
                                                                  "source": {"kind": "oracle", "n": 50}}}, 422,
     ["body", "factor"]),
    ("train: unknown recipient", "POST", "/v1/operators", {"json": {"name": "a", "factor": "logistic", "to": "q",
                                                                     "source": {"kind": "oracle", "n": 50}}}, 422,
     ["body", "to"]),
    ("train: name taken", "POST", "/v1/operators", {"json": {"name": "logistic-x", "factor": "logistic", "to": "x",
                                                              "source": {"kind": "oracle", "n": 50}}}, 409,
     ["body", "name"]),
    ("train: bad name", "POST", "/v1/operators", {"json": {"name": "../etc", "factor": "logistic", "to": "x",
                                                            "source": {"kind": "oracle", "n": 50}}}, 422,
     ["body", "name"]),
    ("train: path outside the store", "POST", "/v1/operators", {"json": {
        "name": "a", "factor": "logistic", "to": "x", "source": {"kind": "file", "path": "../../etc/passwd"}}}, 422,
     ["body", "source", "path"]),
    # file names the OS refuses (found in review: 500 and a reset connection)
    ("train: a NUL in the path", "POST", "/v1/operators", {"json": {
        "name": "a", "factor": "logistic", "to": "x", "source": {"kind": "file", "path": "good.npz\u0000x"}}}, 422,
     ["body", "source", "path"]),
    ("train: a path too long", "POST", "/v1/operators", {"json": {
        "name": "a", "factor": "logistic", "to": "x", "source": {"kind": "file", "path": "x" * 300}}}, 422,
     ["body", "source", "path"]),
    ("train: too few pairs", "POST", "/v1/operators", {"json": {"name": "a", "factor": "logistic", "to": "x",
                                                                 "source": {"kind": "oracle", "n": 1}}}, 422,
     ["body", "source", "n"]),
    ("train: bad range", "POST", "/v1/operators", {"json": {"name": "a", "factor": "logistic", "to": "x", "source": {
        "kind": "oracle", "n": 50, "distribution": {
            "x": {"mean": {"low": -1, "high": 1}, "var": {"low": -1, "high": 1}},
            "z": {"alpha": {"low": 1, "high": 2}, "beta": {"low": 1, "high": 2}}}}}}, 422,
     ["body", "source", "distribution", "x"]),
    # ranges beyond what a request's messages may carry (found in review: 202, then a raw numpy error, or an
    # operator trained on variances 1e-300 .. 1e-200 that the API refuses)
    ("train: range beyond the messages' (mean)", "POST", "/v1/operators", {"json": {"name": "a", "factor": "logistic",
        "to": "x", "source": {"kind": "oracle", "n": 50, "distribution": {
            "x": {"mean": {"low": -1e308, "high": 1e308}, "var": {"low": 1, "high": 2}},
            "z": {"alpha": {"low": 1, "high": 2}, "beta": {"low": 1, "high": 2}}}}}}, 422,
     ["body", "source", "distribution", "x", "mean"]),
    ("train: range beyond the messages' (var)", "POST", "/v1/operators", {"json": {"name": "a", "factor": "logistic",
        "to": "x", "source": {"kind": "oracle", "n": 50, "distribution": {
            "x": {"mean": {"low": -1, "high": 1}, "var": {"low": 1e-300, "high": 1e-200, "scale": "log"}},
            "z": {"alpha": {"low": 1, "high": 2}, "beta": {"low": 1, "high": 2}}}}}}, 422,
     ["body", "source", "distribution", "x", "var"]),
    ("train: missing token", "POST", "/v1/operators", {"json": {"name": "a", "factor": "logistic", "to": "x",
                                                                 "source": {"kind": "oracle", "n": 50}},
                                                        "headers": {"Authorization": ""}}, 401,
     ["header", "authorization"]),
]


def _state(c, name):
    d = c.get(f"/v1/operators/{name}").json()
    if name == "compound_gamma-tau":
        pb = {"to": "tau", "incoming": {"tau": {"family": "gamma", "shape": [2.0, 5.0], "rate": [1.0, 0.3]}}}
    else:
        pb = _good_x()
        pb["to"] = d["to"]
    p = c.post(f"/v1/operators/{name}/messages?mode=predict", json=pb).json()
    return {k: d[k] for k in ("version", "n_train", "counters", "updates", "threshold")}, p["beliefs"], p["log_var"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_naming_the_field_and_changes_nothing(app_client, case):
    _, method, url, kw, status, loc = case
    kw = copy.deepcopy(kw)
    headers = {**AUTH, **kw.pop("headers", {})}
    headers = {k: v for k, v in headers.items() if v != ""}
    names = ["logistic-x", "compound_gamma-tau"]
    before = {n: _state(app_client, n) for n in names}
    ops_before = app_client.get("/v1/operators").json()
    r = app_client.request(method, url, headers=headers, **kw)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, list) and detail and all({"loc", "msg", "type"} <= set(e) for e in detail)
    assert any(e["loc"][:len(loc)] == loc for e in detail), detail
    assert all(e["msg"] for e in detail)
    if status == 401:
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert len(r.content) < 5000  # the input is never echoed back
    for n in names:
        assert _state(app_client, n) == before[n], n
    assert app_client.get("/v1/operators").json() == ops_before
    assert app_client.get("/v1/jobs").json() == {"jobs": []}


def test_predict_needs_no_token_but_jit_and_oracle_do(app_client):
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=_good_x())
    assert r.status_code == 200, r.text
    assert app_client.post("/v1/operators/logistic-x/messages", json=_good_x()).status_code == 401  # default: jit
    assert app_client.post("/v1/operators/logistic-x/messages", json=_good_x(), headers=AUTH).status_code == 200
    # the oracle learns nothing but costs the server real CPU: token holders only
    assert app_client.post("/v1/operators/logistic-x/messages?mode=oracle", json=_good_x()).status_code == 401
    r = app_client.post("/v1/operators/logistic-x/messages?mode=oracle", json=_good_x(), headers=AUTH)
    assert r.status_code == 200, r.text


def test_improper_outgoing_message_is_flagged_not_clipped(app_client):
    # a very broad incoming x with a confident belief gives a proper message; a very narrow incoming
    # message that the belief is wider than gives negative precision: flagged, natural parameters exact
    b = {"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [0.0], "var": [1e-3]},
                                 "z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}}
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=b).json()
    q = as_gaussian(r["beliefs"])
    expect = q / Gaussian([0.0], [1e-3])
    np.testing.assert_array_equal(np.transpose(r["messages"]["natural"]), expect.natural())
    assert r["messages"]["is_proper"] == expect.is_proper.tolist()


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
def test_oracle_failure_is_a_4xx_and_changes_nothing(app_client):
    """The quadrature oracle cannot represent a belief on z squeezed within exp(-745) of 0."""
    b = {"to": "z", "incoming": {"x": {"family": "gaussian", "mean": [-2000.0], "var": [1e-4]},
                                 "z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}}
    before = _state(app_client, "logistic-z")
    r = app_client.post("/v1/operators/logistic-z/messages?mode=oracle", json=b, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "oracle_failed", r.text
    r = app_client.post("/v1/operators/logistic-z/messages?mode=jit", json=b, headers=AUTH)
    if r.status_code == 200:  # the learned operator was confident here: then it did not need the oracle
        assert r.json()["n_consulted"] == 0
    else:
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "oracle_failed", r.text
        assert _state(app_client, "logistic-z") == before


def test_allow_lists_only_the_methods_served(app_client):
    """A 405's ``Allow`` names what the path serves: HEAD is not served (FastAPI's GET routes answer it
    405), so listing it was wrong (found in review: HEAD /health 405 with ``Allow: GET, HEAD``)."""
    for path, allowed in (("/health", {"GET"}), ("/v1/operators", {"GET", "POST"})):
        for method in ("HEAD", "DELETE"):
            r = app_client.request(method, path)
            assert r.status_code == 405, (method, path, r.status_code)
            assert set(r.headers["allow"].replace(" ", "").split(",")) == allowed, r.headers["allow"]


def test_training_a_factor_with_a_text_parameter(app_client):
    """factor_params took numbers only: gamma_rate's (or a user factor's) ``projection: "moments"``
    could not be trained through the service.  Text parameters are accepted; a boolean (JSON true is
    not the number 1 here) or a bad value is a 422 naming factor_params, and nothing is created."""
    c = app_client
    req = {"name": "gr-moments", "factor": "gamma_rate", "to": "r", "n_inner": 20, "n_outer": 30, "threshold": -3.0,
           "factor_params": {"shape": 2, "projection": "moments"}, "source": {"kind": "oracle", "n": 40}}
    for params, why in (({"shape": True}, None), ({"projection": "nonsense"}, "projection"),
                        ({"projection": ""}, None), ({"projection": ["kl"]}, None)):
        r = c.post("/v1/operators", json={**req, "factor_params": params}, headers=AUTH)
        assert r.status_code == 422, (params, r.text)
        loc = r.json()["detail"][0]["loc"]
        assert loc[:2] == ["body", "factor_params"], (params, r.text)
        assert why is None or why in r.json()["detail"][0]["msg"]
    assert c.get("/v1/operators/gr-moments").status_code == 404
    r = c.post("/v1/operators", json=req, headers=AUTH)
    assert r.status_code == 202, r.text
    job = wait_job(c, r.headers["Location"])
    assert job["status"] == "succeeded", job
    d = c.get("/v1/operators/gr-moments").json()
    assert d["factor_params"] == {"shape": 2.0, "projection": "moments"}
    m = c.post("/v1/operators/gr-moments/messages?mode=predict", json=body(probe("gamma_rate", 3), "r"))
    assert m.status_code == 200 and m.json()["projection"] == "moments", m.text


def test_a_numeric_factor_parameter_sent_as_text_is_named(app_client):
    """factor_params take text (a ``projection``), so a number sent as text passed the schema and
    reached the factor, whose range check raised numpy's "ufunc 'isfinite' not supported for the
    input types": a 422 naming neither the parameter nor what it should be.  The factor names it
    (kjit.factors.FactorParamError), at ``factor_params.<name>``, and nothing is created."""
    req = {"name": "cg-text", "factor": "compound_gamma", "to": "tau", "source": {"kind": "oracle", "n": 40}}
    for factor, to, param, value in (("compound_gamma", "tau", "s1", "2"), ("gamma_rate", "r", "shape", "2"),
                                     ("probit_noise", "f", "eps", "0.1")):
        r = app_client.post("/v1/operators", json={**req, "factor": factor, "to": to, "factor_params": {param: value}},
                            headers=AUTH)
        assert r.status_code == 422, r.text
        (err,) = r.json()["detail"]
        assert err["loc"] == ["body", "factor_params", param], r.text
        assert f"`{param}` must be a number" in err["msg"] and "ufunc" not in err["msg"], r.text
    r = app_client.post("/v1/operators", json={**req, "factor_params": {"s1": -1}}, headers=AUTH)  # a range, named too
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "factor_params", "s1"], r.text
    assert app_client.get("/v1/operators/cg-text").status_code == 404


def test_served_log_var_is_weighted_beyond_the_learned_curvature(live, store_dir, pristine_store):
    """Messages far from the training distribution (cavity means 8–25 sd out) whose predicted belief is
    narrower than any learned relative to its reference get weights > 1 (KernelOperator.decision_log_weights):
    mode=predict serves the weighted log variance, exactly the library's (screen_certified), above the
    operator's raw predictive one on some rows — a served log_var that dropped the weights (or a snapshot that
    lost ``curvature_top``) fails here, not on in-distribution probes, whose weights are 1."""
    local = load_pristine(pristine_store, "logistic-x")
    rng = np.random.default_rng(59)
    n = 40
    mean = rng.choice([-1.0, 1.0], n) * rng.uniform(8.0, 25.0, n)
    var = np.exp(rng.uniform(np.log(0.1), np.log(3.0), n))
    label = rng.random(n) < 0.5
    inc = {"x": Gaussian(mean, var), "z": Beta(np.where(label, 2.0, 1.0), np.where(label, 1.0, 2.0))}
    with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/operators/logistic-x/messages", params={"mode": "predict"}, json=body(inc, "x")).json()
    served = np.transpose(r["log_var"])
    np.testing.assert_array_equal(served, local.screen_certified(inc)[1].log_var)
    _, raw = local.operator.predict(inc)
    assert np.all(served >= raw) and np.any(served > raw + 1e-3)
    np.testing.assert_array_equal(r["certificates"]["log_var"], r["log_var"])
