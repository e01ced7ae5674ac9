"""Hostile and extreme input (issue 21): finite extremes are 422s naming the field and change
nothing (JIT counters included); observations are validated as data (no poisoning); error
reports are bounded; numbers are strict; idempotency keys compare canonical JSON; responses
carry no server paths or exception text; resources are bounded (oracle batch, job sizes,
job queue); an operator that cannot predict is reported failed by /ready."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kjit.families import Beta, Gaussian
from kjit.oracles import QuadratureOracle
from service import create_app
from service.files import encode_record
from service.validation import MAX_VALUES_PER_ROW

from test_service_fixtures import (  # noqa: F401 - fixtures
    TOKEN,
    app_client,
    pristine_store,
    settings_for,
    poll,
    store_dir,
    wait_job,
    wait_ready,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def good_x(n=3):
    return {"to": "x", "incoming": {
        "x": {"family": "gaussian", "mean": [0.0, 2.0, -1.0][:n], "var": [1.0, 0.5, 2.0][:n]},
        "z": {"family": "beta", "alpha": [2.0, 1.0, 2.0][:n], "beta": [1.0, 2.0, 1.0][:n]}}}


def state(c, name="logistic-x"):
    d = c.get(f"/v1/operators/{name}").json()
    p = c.post(f"/v1/operators/{name}/messages?mode=predict", json=good_x()).json()
    return ({k: d[k] for k in ("version", "n_train", "counters", "updates", "threshold")},
            p["beliefs"], p["log_var"])


def extreme(mean, var=1.0):
    return {"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [mean], "var": [var]},
                                    "z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}}


def locs(r):
    return [tuple(d["loc"]) for d in r.json()["detail"]]


# ------------------------------------------------------------------------------ finite extremes
@pytest.mark.parametrize("mode", ["predict", "jit", "oracle"])
def test_the_issue_s_1e308_mean_is_a_422_naming_it_in_every_mode(app_client, mode):
    app_client.post("/v1/operators/logistic-x/messages?mode=jit", json=good_x(), headers=AUTH)  # counters > 0
    before = state(app_client)
    assert before[0]["counters"]["calls"] > 0
    r = app_client.post(f"/v1/operators/logistic-x/messages?mode={mode}", json=extreme(1e308), headers=AUTH)
    assert r.status_code == 422, r.text
    assert locs(r) == [("body", "incoming", "x", "mean", 0)]
    assert "1e+100" in r.json()["detail"][0]["msg"]
    assert state(app_client) == before
    assert app_client.get("/health").status_code == 200  # the connection and the server are fine


@pytest.mark.parametrize("name,body", [
    # the logistic oracle's OracleError (a label message Beta(1, 1e100): x's message N(1e100, 1), the example
    # before, is answered in closed form since the thirty-ninth session), and the compound-gamma oracle's refusal
    # of a shape whose tilted density spreads beyond what its rule resolves (shape 1e-6 was a bare ValueError;
    # it is answered now): within the documented range, but more than the oracle can carry
    ("logistic-x", {"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [0.0], "var": [1.0]},
                                            "z": {"family": "beta", "alpha": [1.0], "beta": [1e100]}}}),
    ("compound_gamma-tau", {"to": "tau", "incoming": {"tau": {"family": "gamma", "shape": [1e-11], "rate": [1.0]}}}),
])
def test_an_oracle_that_cannot_carry_finite_input_is_a_422_and_jit_keeps_its_counters(app_client, name, body):
    # such a ValueError used to be a 500, and the jit request's recovery reset the counters
    ok = {"logistic-x": good_x(),
          "compound_gamma-tau": {"to": "tau", "incoming": {"tau": {"family": "gamma", "shape": [2.0], "rate": [1.0]}}}}
    app_client.post(f"/v1/operators/{name}/messages?mode=jit", json=ok[name], headers=AUTH)  # counters > 0

    def snap():
        d = app_client.get(f"/v1/operators/{name}").json()
        p = app_client.post(f"/v1/operators/{name}/messages?mode=predict", json=ok[name]).json()
        return {k: d[k] for k in ("version", "n_train", "counters", "updates")}, p["beliefs"]
    before = snap()
    assert before[0]["counters"]["calls"] > 0
    for mode in ("oracle", "jit"):
        r = app_client.post(f"/v1/operators/{name}/messages?mode={mode}", json=body, headers=AUTH)
        # (jit: the operator is uncertain this far out, so it consults the oracle, which fails)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["type"] in ("oracle_failed", "not_computable")
        assert r.json()["detail"][0]["loc"][:2] == ["body", "incoming"]
        assert "Traceback" not in r.text
    assert snap() == before


@pytest.mark.parametrize("field,value", [("var", 1e-101), ("var", 1e101), ("alpha", 1e101), ("alpha", 1e-300)])
def test_parameters_outside_the_documented_range_are_422s(app_client, field, value):
    b = good_x(1)
    v = "x" if field == "var" else "z"
    b["incoming"][v][field] = [value]
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=b)
    assert r.status_code == 422 and locs(r) == [("body", "incoming", v, field, 0)], r.text


# ------------------------------------------------------------------------------ poisoning
def _obs(incoming, beliefs):
    return {"incoming": incoming, "beliefs": beliefs}


def test_the_issue_s_poisoned_observation_is_rejected_naming_the_row(app_client):
    before = state(app_client)
    inc = good_x()["incoming"]
    for big, loc in ((1e300, ("body", "beliefs", "mean", 1)),  # beyond the documented range
                     (1e90, ("body", "beliefs", 1))):  # in range, but no factor produces it
        beliefs = {"family": "gaussian", "mean": [0.4, big, 0.1], "var": [0.8, 0.8, 0.9]}
        r = app_client.post("/v1/operators/logistic-x/observations", json=_obs(inc, beliefs), headers=AUTH)
        assert r.status_code == 422, r.text
        assert locs(r) == [loc]
    assert state(app_client) == before


def test_a_moderately_wrong_belief_is_rejected_and_the_oracle_s_own_is_accepted(app_client):
    inc = {"x": {"family": "gaussian", "mean": [0.0], "var": [1.0]},
           "z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}
    before = state(app_client)
    # 40 prior standard deviations away: no logistic factor produces this from N(0, 1)
    r = app_client.post("/v1/operators/logistic-x/observations",
                        json=_obs(inc, {"family": "gaussian", "mean": [40.0], "var": [0.5]}), headers=AUTH)
    assert r.status_code == 422 and locs(r) == [("body", "beliefs", 0)], r.text
    assert "implausible" in r.text
    assert state(app_client) == before
    # an honest but unusual observation (a broad incoming message, beyond the training distribution) is accepted
    # and learned
    from kjit.factors import Logistic
    for var, learned in ((300.0, True), (3e3, False)):
        x, z = Gaussian([3.0], [var]), Beta([1.0], [2.0])
        q = QuadratureOracle(Logistic()).belief({"x": x, "z": z}, "x")
        inc = {"x": {"family": "gaussian", **x.to_dict()}, "z": {"family": "beta", **z.to_dict()}}
        r = app_client.post("/v1/operators/logistic-x/observations",
                            json=_obs(inc, {"family": "gaussian", **q.to_dict()}), headers=AUTH)
        assert r.status_code == 200, r.text
        # (one much broader lies outside the data the operator learned — beyond its input margin: acknowledged,
        # not learned; the version stays)
        assert (r.json()["accepted"], r.json()["not_learned"]) == ((1, 0) if learned else (0, 1)), r.text
        assert r.json()["version"] == before[0]["version"] + 1


@pytest.mark.parametrize("name,factor,to", [("logistic-x", "logistic", "x"), ("logistic-z", "logistic", "z"),
                                            ("compound_gamma-tau", "compound_gamma", "tau")])
def test_plausible_observations_still_learn(app_client, name, factor, to):
    from kjit.factors import get_factor
    from test_service_fixtures import probe
    inc = probe(factor, 200, seed=5)  # the training distribution: every honest row is accepted
    q = QuadratureOracle(get_factor(factor)).belief(inc, to)
    body = _obs({v: {"family": type(m).__name__.lower(), **m.to_dict()} for v, m in inc.items()},
                {"family": type(q).__name__.lower(), **q.to_dict()})
    r = app_client.post(f"/v1/operators/{name}/observations", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    # and learned, but for the few below the density guard (1 % of such messages in expectation: at most 10
    # of 200 unless the guard's share were several times its calibrated 1 %)
    out = r.json()
    assert out["accepted"] + out["not_learned"] == 200 and out["not_learned"] <= 10, r.text


# ------------------------------------------------------------------------------ bodies and numbers
@pytest.mark.parametrize("raw,loc0", [
    (b'{"to": "x", "incoming": {"x": {"family": "gaussian", "mean": ["1.5"], "var": [1.0]}, '
     b'"z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}}', ("body", "incoming", "x", "mean", 0)),
    (b'{"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [true], "var": [1.0]}, '
     b'"z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}}', ("body", "incoming", "x", "mean", 0)),
    (b'{"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [' + b"9" * 5000 + b'], "var": [1.0]}}}',
     ("body",)),
    (b"\xff\xfe{}", ("body",)),
    (b"[" * 100_000, ("body",)),
])
def test_strict_numbers_and_unparseable_bodies_are_422s_with_a_loc(app_client, raw, loc0):
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", content=raw,
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert locs(r)[0][:len(loc0)] == loc0


def test_error_reports_are_bounded(app_client):
    inc = {f"v{i}": {"family": "gaussian", "mean": [0.0], "var": [-1.0]} for i in range(50)}
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json={"to": "x", "incoming": inc})
    assert r.status_code == 422
    d = r.json()
    assert len(d["detail"]) == 20 and d["error_count"] >= 50


def test_a_long_list_of_bad_numbers_costs_one_error(app_client):
    b = good_x(1)
    b["incoming"]["x"]["mean"] = ["x"] * 5000
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=b)
    assert r.status_code == 422
    assert locs(r) == [("body", "incoming", "x", "mean", 0)] and len(r.content) < 2000


def test_a_body_with_more_values_than_any_valid_request_is_refused_unparsed(app_client):
    n = 500 * MAX_VALUES_PER_ROW + 1001  # settings_for: max_batch 500
    raw = b'{"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [' + b'"a",' * n + b'0]}}}'
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", content=raw,
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "too_many_values"


def test_idempotency_compares_the_canonical_json(app_client):
    from kjit.factors import Logistic
    from test_service_fixtures import probe
    inc = probe("logistic", 3, seed=9)
    q = QuadratureOracle(Logistic()).belief(inc, "x")
    body = _obs({v: {"family": type(m).__name__.lower(), **m.to_dict()} for v, m in inc.items()},
                {"family": "gaussian", **q.to_dict()})
    h = {**AUTH, "Idempotency-Key": "k-1", "Content-Type": "application/json"}
    r1 = app_client.post("/v1/operators/logistic-x/observations", content=json.dumps(body).encode(), headers=h)
    assert r1.status_code == 200 and not r1.json()["duplicate"]
    # the same JSON, re-serialised: other key order, whitespace, 1 for 1.0
    text = json.dumps(dict(reversed(list(body.items()))), indent=2)
    r2 = app_client.post("/v1/operators/logistic-x/observations", content=text.encode(), headers=h)
    assert r2.status_code == 200 and r2.json()["duplicate"] and r2.json()["version"] == r1.json()["version"]
    body["beliefs"]["mean"][0] += 1e-3
    r3 = app_client.post("/v1/operators/logistic-x/observations", json=body, headers=h)
    assert r3.status_code == 409


# ------------------------------------------------------------------------------ resources
def test_oracle_mode_has_a_batch_limit(store_dir):
    with TestClient(create_app(settings_for(store_dir, max_oracle_batch=5))) as c:
        wait_ready(c)
        b = good_x(1)
        for v in b["incoming"].values():
            for p in list(v)[1:]:
                v[p] = v[p] * 6
        r = c.post("/v1/operators/logistic-x/messages?mode=oracle", json=b, headers=AUTH)
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "too_long"
        assert c.post("/v1/operators/logistic-x/messages?mode=predict", json=b).status_code == 200
        # and so has mode=jit (its oracle work and greedy selection grow with its rows, under the operator's
        # write lock: 10 000 uncertain rows held it for 130 s — found by an audit); nothing learned
        v0 = c.get("/v1/operators/logistic-x").json()["version"]
        r = c.post("/v1/operators/logistic-x/messages?mode=jit", json=b, headers=AUTH)
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "too_long" and "mode=jit" in r.text
        assert c.get("/v1/operators/logistic-x").json()["version"] == v0


def test_busy_oracle_slots_answer_429_with_retry_after(store_dir):
    app = create_app(settings_for(store_dir, oracle_wait=0.0))
    with TestClient(app) as c:
        wait_ready(c)
        assert app.state.oracle_slots.acquire(timeout=1)  # someone else's oracle request
        try:
            r = c.post("/v1/operators/logistic-x/messages?mode=oracle", json=good_x(), headers=AUTH)
            assert r.status_code == 429 and "Retry-After" in r.headers
        finally:
            app.state.oracle_slots.release()
        assert c.post("/v1/operators/logistic-x/messages?mode=oracle", json=good_x(), headers=AUTH).status_code == 200


def _job(name, **kw):
    return {"name": name, "factor": "logistic", "to": "x", "source": {"kind": "oracle", "n": 40},
            "n_inner": 10, "n_outer": 20, "threshold": 0.0, "initial_batch": 20, **kw}


def test_training_limits_and_queue_cap(store_dir):
    app = create_app(settings_for(store_dir, max_queued_jobs=1, max_train_n=1000, max_n_outer=300))
    with TestClient(app) as c:
        wait_ready(c)
        r = c.post("/v1/operators", json=_job("big", source={"kind": "oracle", "n": 5000}, n_outer=500),
                   headers=AUTH)
        assert r.status_code == 422
        assert set(locs(r)) == {("body", "source", "n"), ("body", "n_outer")}
        r = c.post("/v1/operators", json=_job("is", source={"kind": "oracle", "n": 40, "oracle": "importance_sampling",
                                                           "n_samples": 5_000_000}), headers=AUTH)
        assert r.status_code == 422 and locs(r) == [("body", "source", "n_samples")]
        r = c.post("/v1/operators", json=_job("missing", source={"kind": "file", "path": "nope.npz"}), headers=AUTH)
        assert r.status_code == 422 and str(store_dir) not in r.text and "training-sets" not in r.text
        jobs = app.state.jobs
        gate = __import__("threading").Event()
        orig = jobs._run
        jobs._run = lambda job: (gate.wait(30), orig(job))  # hold the first job in the queue
        try:
            assert c.post("/v1/operators", json=_job("one"), headers=AUTH).status_code == 202
            r = c.post("/v1/operators", json=_job("two"), headers=AUTH)
            assert r.status_code == 429 and r.headers["Retry-After"]
        finally:
            gate.set()


# ------------------------------------------------------------------------------ /ready
def test_an_operator_that_cannot_predict_is_reported_failed(store_dir):
    # a log record the old server accepted (belief mean 1e307): replayed, every prediction overflows
    path = store_dir / "operators" / "logistic-x"
    rec = {"seq": 1, "kind": "observe", "time": 0.0,
           "incoming": {"x": {"mean": [0.0], "var": [1.0]}, "z": {"alpha": [2.0], "beta": [1.0]}},
           "beliefs": {"mean": [1e307], "var": [0.8]}}
    with open(path / "log-00000000.jsonl", "ab") as fh:
        fh.write(encode_record(rec))
    with TestClient(create_app(settings_for(store_dir))) as c:
        r = poll(lambda: c.get("/ready"), lambda r: not r.json()["loading"], timeout=120)
        assert r.status_code == 503
        assert "logistic-x" in r.json()["failed"], r.text
        assert "cannot predict" in r.json()["failed"]["logistic-x"] or "not finite" in r.json()["failed"]["logistic-x"]
        assert c.post("/v1/operators/logistic-x/messages?mode=predict", json=good_x()).status_code == 503


def test_openapi_documents_the_request_bodies_parsed_outside_fastapi(app_client):
    spec = app_client.get("/openapi.json").json()
    for path, model in (("/v1/operators/{name}/messages", "MessagesRequest"),
                        ("/v1/operators/{name}/observations", "ObservationsRequest"),
                        ("/v1/operators", "TrainRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert model in spec["components"]["schemas"]
    # every reference resolves
    text = json.dumps(spec)
    import re
    for name in set(re.findall(r'#/components/schemas/([A-Za-z0-9_]+)', text)):
        assert name in spec["components"]["schemas"], name


def test_health_answers_while_a_large_invalid_body_is_parsed(store_dir):
    import threading
    import time

    import httpx
    from service.testing import ThreadedServer

    with ThreadedServer(settings_for(store_dir, max_body_bytes=16 * 2**20, max_batch=10_000)) as srv:
        body = b'{"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [' + b'"a",' * 4_000_000 + b'0]}}}'
        calls = []  # (start, end) of each /health call
        ready, done = threading.Event(), threading.Event()

        def poll():
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                while not done.is_set():
                    t = time.perf_counter()
                    assert c.get("/health").status_code == 200
                    calls.append((t, time.perf_counter()))
                    ready.set()
        t = threading.Thread(target=poll)
        t.start()
        assert ready.wait(30)  # the poller is answering before the large request is sent
        try:
            t0 = time.perf_counter()
            r = httpx.post(srv.url + "/v1/operators/logistic-x/messages?mode=predict", content=body,
                           headers={"Content-Type": "application/json"}, timeout=60)
            t1 = time.perf_counter()
        finally:
            done.set()
            t.join()
        assert r.status_code == 422 and len(r.content) < 2000
        assert r.json()["detail"][0]["type"] == "too_many_values"
        # /health was answered while the request was in flight: a call that began after the large
        # request was sent ended before its answer came back
        assert any(t0 <= a and b <= t1 for a, b in calls), (t1 - t0, len(calls))


def test_a_body_with_thousands_of_keys_is_refused_unparsed(app_client):
    raw = ("{" + ",".join(f'"k{i}": {i}' for i in range(5000)) + "}").encode()
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", content=raw,
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"] == [
        {"loc": ["body"], "type": "too_many_keys", "msg": r.json()["detail"][0]["msg"]}]


@pytest.mark.parametrize("mode", ["predict", "jit"])
def test_a_key_repeated_within_an_object_is_a_422_naming_it_and_changes_nothing(app_client, mode):
    """pydantic keeps the last of repeated keys (another parser, e.g. a proxy's, the first): the
    same bytes would mean two different messages, so the body is refused, at the repeated key."""
    before = state(app_client)
    good = json.dumps(good_x(1))
    bodies = {  # (the repeated key, where)
        ("body", "incoming", "x", "mean"): good.replace('"mean": [0.0]', '"mean": [0.0], "mean": [1e3]'),
        ("body", "to"): good.replace('{"to": "x"', '{"to": "z", "to": "x"'),
        ("body", "incoming", "z"): good.replace('"incoming": {', '"incoming": {"z": {"family": "gaussian", '
                                                '"mean": [1.0], "var": [1.0]}, '),
    }
    for loc, raw in bodies.items():
        assert json.loads(raw)  # valid JSON, and valid for the schema once the duplicate is dropped
        r = app_client.post(f"/v1/operators/logistic-x/messages?mode={mode}", content=raw.encode(),
                            headers={"Content-Type": "application/json", **AUTH})
        assert r.status_code == 422, (loc, r.text)
        assert r.json()["detail"][0]["type"] == "duplicate_key" and tuple(r.json()["detail"][0]["loc"]) == loc
    r = app_client.post("/v1/operators/logistic-x/observations", headers={"Content-Type": "application/json", **AUTH},
                        content=json.dumps({"incoming": good_x(1)["incoming"], "beliefs": {
                            "family": "gaussian", "mean": [0.1], "var": [0.5]}}).replace(
                            '"var": [0.5]', '"var": [0.5], "var": [0.4]').encode())
    assert r.status_code == 422 and locs(r) == [("body", "beliefs", "var")]
    assert state(app_client) == before
    # the same keys in different objects are not repeats
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", content=good.encode(),
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 200


def test_duplicate_key_locates_the_repeat_in_nested_lists_and_reads_only_json():
    from service.validation import duplicate_key

    assert duplicate_key(b'{"a": [1, {"b": 1}, [{"c": 1, "c": 2}]]}') == ["a", 2, 0, "c"]
    assert duplicate_key(b'{"a": {"b": 1}, "b": {"a": 2}}') is None
    assert duplicate_key(b'{"a": 1, "a": 1}') == ["a"]  # (even with the same value)
    assert duplicate_key(b"not json") is None and duplicate_key(b"[" * 100000) is None
    # arrays of numbers are emptied before the scan: a repeat that this creates is not reported
    assert duplicate_key(b'{"p": {"a[1]": 1, "a[2]": 2}, "m": [1, 2.5e3, -3]}') is None
    assert duplicate_key(b'{"p": {"a[1]": 1, "a[1]": 2}}') == ["p", "a[1]"]
    assert duplicate_key(b'{"l": [[1, 2], [3]], "q": [{"k": [1]}, {"k": [2], "k": [3]}]}') == ["q", 1, "k"]


def test_the_limits_are_kjit_environment_settings():
    from service.settings import Settings

    s = Settings.from_env({"KJIT_MAX_QUEUED_JOBS": "2", "KJIT_MAX_TRAIN_N": "500", "KJIT_MAX_N_INNER": "50",
                           "KJIT_MAX_N_OUTER": "80", "KJIT_MAX_N_SAMPLES": "1000", "KJIT_MAX_ORACLE_BATCH": "7",
                           "KJIT_ORACLE_CONCURRENCY": "3", "KJIT_ORACLE_WAIT": "0.5", "KJIT_OBSERVATION_MAX_Z": "4",
                           "KJIT_OBSERVATION_MAX_KL": "0.1"})
    assert (s.max_queued_jobs, s.max_train_n, s.max_n_inner, s.max_n_outer, s.max_n_samples, s.max_oracle_batch,
            s.oracle_concurrency, s.oracle_wait, s.observation_max_z, s.observation_max_kl) == (
        2, 500, 50, 80, 1000, 7, 3, 0.5, 4.0, 0.1)
    for key, bad in (("KJIT_MAX_QUEUED_JOBS", "0"), ("KJIT_ORACLE_WAIT", "-1"), ("KJIT_OBSERVATION_MAX_KL", "nan"),
                     ("KJIT_MAX_ORACLE_BATCH", "x")):
        with pytest.raises(ValueError):
            Settings.from_env({key: bad})
    # found by an audit: accepted, then failing late (after the default operators were trained, in every
    # training job), or an empty store read as the current directory
    for key, bad, field in (("KJIT_LOG_LEVEL", "bogus", "log_level"), ("KJIT_N_JOBS", "0", "n_jobs"),
                            ("KJIT_STORE", "", "store"), ("KJIT_STORE", "  ", "store")):
        with pytest.raises(ValueError, match=f"`{field}`"):
            Settings.from_env({key: bad})
    assert Settings.from_env({"KJIT_LOG_LEVEL": "WARNING", "KJIT_N_JOBS": "-1"}).log_level == "warning"


def test_a_malformed_job_record_is_skipped_not_fatal(store_dir):
    """Found by an audit: a record whose "progress" was a number stopped the server's start."""
    from service.testing import ThreadedServer

    jobs = store_dir / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    (jobs / "abc.json").write_text(json.dumps({"id": "abc", "operator": "x", "status": "failed", "progress": 5}))
    (jobs / "abd.json").write_text(json.dumps({"id": "abd", "operator": "x", "status": "weird"}))
    (jobs / "abe.json").write_text("[1]")
    (jobs / "abf.json").write_text('{"id": "abf", "operator": "x", "status": "failed", "progress": {"done": 1e999}}')
    (jobs / "abg.json").write_text("[" * 100000 + "]" * 100000)  # (found in review: these two still stopped it)
    with ThreadedServer(settings_for(store_dir)) as srv:
        import httpx

        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        assert httpx.get(srv.url + "/v1/jobs/abc", timeout=30).status_code == 404


def test_training_errors_name_fields_of_the_body(app_client):
    """pydantic's labels of union members ("literal['default']", "dict[str,...]") and the client
    source's tag are not fields of the body (found by an audit)."""
    bad = {"name": "a", "factor": "logistic", "to": "x", "source": {"kind": "oracle", "n": 50, "distribution": "nope"}}
    r = app_client.post("/v1/operators", json=bad, headers=AUTH)
    assert r.status_code == 422 and set(locs(r)) == {("body", "source", "distribution")}, r.text
    bad["source"]["distribution"] = {"x": {"mean": {"low": "a", "high": 1.0}}}
    r = app_client.post("/v1/operators", json=bad, headers=AUTH)
    assert r.status_code == 422 and all("[" not in str(x) for loc in locs(r) for x in loc), r.text
    bad["source"] = {"kind": "client", "variables": {"x": "gaussian", "y": "gaussian"}, "output": "z",
                     "incoming": {"x": {"family": "gaussian", "mean": [0.0] * 4, "var": [1.0] * 4},
                                  "y": {"family": "gaussian", "mean": [0.0] * 4, "var": [1.0] * 4}},
                     "beliefs": {"family": "gaussian", "mean": [0.0] * 4, "var": [1.0, 1.0, 1.0, "no"]}}
    r = app_client.post("/v1/operators", json=bad, headers=AUTH)
    assert r.status_code == 422 and ("body", "source", "beliefs", "var", 3) in locs(r), r.text
    # a key the caller chose that looks like a label is kept (found in review: it was dropped)
    body = good_x(1)
    body["incoming"]["w[0]"] = {"family": "gaussian", "mean": [0.0], "var": [-1.0]}
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=body)
    assert r.status_code == 422 and ("body", "incoming", "w[0]", "var", 0) in locs(r), r.text


def test_a_training_file_that_is_not_a_training_set_of_this_direction_is_a_422(app_client, store_dir):
    """Found by an audit: such files were accepted (202) and the job failed later with EOFError,
    KeyError, ... in its error; now the request is refused at the path, and no job is queued."""
    d = store_dir / "training-sets"
    d.mkdir(parents=True, exist_ok=True)
    (d / "empty.npz").write_bytes(b"")
    np.savez(d / "plain.npz", a=np.arange(3.0))
    from kjit.factors import Logistic
    from kjit.training import make_training_set

    make_training_set(Logistic(), "z", lambda n, rng: {"x": Gaussian(rng.normal(size=n), np.ones(n)),
                                                       "z": Beta(np.full(n, 2.0), np.ones(n))},
                      QuadratureOracle(Logistic()), n=10, random_state=0).save(d / "z10.npz")
    # (found in review: a file whose x messages are Beta passed the check of factor and recipient)
    z = dict(np.load(d / "z10.npz", allow_pickle=False))
    h = json.loads(str(z["header"]))
    h.update(to="x", belief="gaussian", incoming={"x": "beta", "z": "beta"})
    z.update(header=np.array(json.dumps(h)), **{"incoming.x.alpha": np.full(10, 2.0), "incoming.x.beta": np.ones(10),
                                                "belief.mean": np.zeros(10), "belief.var": np.ones(10)})
    for key in ("incoming.x.mean", "incoming.x.var", "belief.alpha", "belief.beta"):
        z.pop(key, None)
    np.savez(d / "x_as_beta.npz", **z)
    jobs_before = len(app_client.get("/v1/jobs").json()["jobs"])
    for name, words in (("empty.npz", "not a kjit training set"), ("plain.npz", "no header"),
                        ("z10.npz", "logistic→z, not logistic→x"), ("x_as_beta.npz", "must be a Gaussian message")):
        r = app_client.post("/v1/operators", headers=AUTH, json={
            "name": "f", "factor": "logistic", "to": "x", "source": {"kind": "file", "path": name}})
        assert r.status_code == 422 and locs(r) == [("body", "source", "path")], r.text
        msg = r.json()["detail"][0]["msg"]
        assert words in msg and str(store_dir) not in msg, msg
    assert len(app_client.get("/v1/jobs").json()["jobs"]) == jobs_before


def test_the_first_update_does_not_need_new_files_for_its_blas_limit(store_dir, monkeypatch):
    """The store learns with one BLAS thread (service.store.blas); the first update imported threadpoolctl
    and read the process's libraries — with the descriptors exhausted by idle connections that raised
    OSError: a 500 on every update (found by an audit).  They are found when the store opens."""
    import threadpoolctl

    import service.store.blas as blas

    monkeypatch.setattr(blas, "_controller", None)
    with TestClient(create_app(settings_for(store_dir))) as c:
        wait_ready(c)

        def no_files(*a, **k):
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(threadpoolctl.ThreadpoolController, "__init__", no_files)
        r = c.post("/v1/operators/logistic-x/messages?mode=jit", json=good_x(3), headers=AUTH)
        assert r.status_code == 200, r.text


def test_the_server_runs_blas_on_one_thread_by_default(store_dir):
    """KJIT_BLAS_THREADS (default 1): a one-message prediction at D 500/1000 took 8.0 ms with OpenBLAS's
    default two threads on a 2-core host with one core busy, 0.30 ms with one (found by an audit: the
    benchmarks pinned it, ``make run`` did not)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from service.settings import Settings

    def blas_threads():
        return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    assert Settings.from_env({}).blas_threads == 1 and Settings.from_env({"KJIT_BLAS_THREADS": "0"}).blas_threads == 0
    with pytest.raises(ValueError, match="`blas_threads`"):
        Settings.from_env({"KJIT_BLAS_THREADS": "-1"})
    with threadpool_limits(2, user_api="blas"):  # (as a process whose BLAS starts with two)
        assert blas_threads() == {2}
        with TestClient(create_app(settings_for(store_dir, blas_threads=0))):
            assert blas_threads() == {2}  # 0: left as it is
        with TestClient(create_app(settings_for(store_dir))):
            assert blas_threads() == {1}
        assert blas_threads() == {2}  # the app's setting ends with it (a process embedding it keeps its own)


def _long_cases(n):
    """(label, path, body) of requests carrying one client text of ``n`` characters."""
    long = "q" * n
    oracle = {"kind": "oracle", "n": 10}
    client = {"kind": "client", "variables": {"x": "gaussian", "y": "gaussian"}, "output": long,
              "incoming": {"x": {"family": "gaussian", "mean": [0.0] * 4, "var": [1.0] * 4}},
              "beliefs": {"family": "gaussian", "mean": [0.0] * 4, "var": [1.0] * 4}}
    predict = "/v1/operators/logistic-x/messages?mode=predict"
    extra = good_x(1)
    extra["incoming"]["x"][long] = 1.0
    return [
        ("predict to", predict, {**good_x(1), "to": long}),
        ("predict incoming key", predict, {"to": "x", "incoming": {**good_x(1)["incoming"], long: good_x(1)["incoming"]["x"]}}),
        ("predict unknown field", predict, extra),
        ("training factor", "/v1/operators", {"name": "a1", "factor": long, "to": "x", "source": oracle}),
        ("training to", "/v1/operators", {"name": "a2", "factor": "logistic", "to": long, "source": oracle}),
        ("training factor_params key", "/v1/operators",
         {"name": "a3", "factor": "logistic", "to": "x", "factor_params": {long: 1.0}, "source": oracle}),
        ("training output", "/v1/operators", {"name": "a4", "factor": "mine", "to": "x", "source": client}),
        ("training file path", "/v1/operators",
         {"name": "a5", "factor": "logistic", "to": "x", "source": {"kind": "file", "path": long}}),
    ]


@pytest.mark.parametrize("n", [150, 1_000_000], ids=["150_chars", "1M_chars"])
def test_long_client_text_is_quoted_never_echoed(app_client, n):
    """Found by an audit: a 15 MiB `to` (mode=predict, no token), a training `factor`, `to` or `output`
    came back whole in the 422.  Names are bounded (4096 characters) and error messages and locs quote
    at most 100 characters of what was sent."""
    for label, path, body in _long_cases(n):
        r = app_client.post(path, json=body, headers=AUTH)
        assert r.status_code == 422, (label, r.text[:300])
        assert len(r.content) < 2000, (label, len(r.content), r.text[:300])
        assert "q" * 101 not in r.text, label
    r = app_client.get("/v1/jobs/" + "j" * 5000)
    assert r.status_code == 404 and len(r.content) < 500
    raw = b'{"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [0.0], "var": [1.0]}, "z": ' \
          b'{"family": "beta", "alpha": [2.0], "beta": [1.0]}}, "' + b"k" * 150 + b'": 1, "' + b"k" * 150 + b'": 2}'
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", content=raw,
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "k" * 101 not in r.text, r.text[:300]


def test_names_are_bounded_but_not_narrowed(app_client):
    """4096 characters at most (as a path); otherwise what was accepted is (the factors' rules decide)."""
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json={**good_x(1), "to": "é" * 4096})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "unknown_recipient" and len(r.content) < 2000
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json={**good_x(1), "to": "é" * 4097})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "string_too_long"


def test_the_library_quotes_an_unknown_factor_s_name_briefly():
    from kjit.errors import quoted
    from kjit.factors import UnknownFactorError, get_factor

    with pytest.raises(UnknownFactorError) as info:
        get_factor("f" * 100_000)
    assert len(str(info.value)) < 2000 and info.value.name == "f" * 100_000
    assert quoted("abc") == "'abc'" and quoted("a" * 101) == repr("a" * 100) + "…" and quoted("a" * 50, 40).endswith("…")


def test_training_requests_whose_job_would_fail_are_422s_and_start_no_job(app_client):
    """Found by an audit: each was accepted (202) and its job failed — probit_noise → y from its default
    distribution (observed labels, infinite log-odds; it was also among the default specs), a client's belief
    with non-finite regression coordinates, pairs all the same, ranges all points."""
    from service.training import default_specs

    assert "probit_noise-y" not in default_specs() and "probit_noise-f" in default_specs()
    small = {"n_inner": 10, "n_outer": 20}
    client = {"kind": "client", "variables": {"f": "gaussian", "y": "bernoulli"}, "output": "y",
              "incoming": {"f": {"family": "gaussian", "mean": [0, 1, 2, 3], "var": [1, 1, 1, 1]},
                           "y": {"family": "bernoulli", "p": [0.5, 0.5, 0.5, 0.5]}},
              "beliefs": {"family": "bernoulli", "p": [0.5, 0.6, 0.7, 0.0]}}
    same = {**client, "incoming": {"f": {"family": "gaussian", "mean": [1, 1, 1, 1], "var": [1, 1, 1, 1]},
                                   "y": client["incoming"]["y"]},
            "beliefs": {"family": "bernoulli", "p": [0.6, 0.6, 0.6, 0.6]}}
    points = {"x": {"mean": {"low": 0, "high": 0}, "var": {"low": 1, "high": 1}},
              "z": {"alpha": {"low": 2, "high": 2}, "beta": {"low": 1, "high": 1}}}
    cases = [
        ({"name": "pa", "factor": "probit_noise", "to": "y", "source": {"kind": "oracle", "n": 50}}, ["body", "to"]),
        ({"name": "pb", "factor": "myf", "to": "y", "source": client}, ["body", "source", "beliefs", 3]),
        ({"name": "pc", "factor": "myf", "to": "y", "source": same}, ["body", "source", "incoming"]),
        ({"name": "pd", "factor": "logistic", "to": "x", "source": {"kind": "oracle", "n": 50, "distribution": points}},
         ["body", "source", "distribution"]),
    ]
    jobs = len(app_client.get("/v1/jobs", headers=AUTH).json()["jobs"])
    for req, loc in cases:
        r = app_client.post("/v1/operators", json={**small, **req}, headers=AUTH)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == loc, (loc, r.text)
    assert len(app_client.get("/v1/jobs", headers=AUTH).json()["jobs"]) == jobs
    # the same with a spread: accepted (the checks refuse only what the job would fail on)
    spread = {**points, "x": {"mean": {"low": -1, "high": 1}, "var": {"low": 1, "high": 1}}}
    r = app_client.post("/v1/operators", json={**small, "name": "pe", "factor": "logistic", "to": "x",
                                               "source": {"kind": "oracle", "n": 50, "distribution": spread}},
                        headers=AUTH)
    assert r.status_code == 202, r.text
    assert wait_job(app_client, r.headers["location"])["status"] == "succeeded"
