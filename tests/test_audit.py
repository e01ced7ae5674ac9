"""The continuous accuracy audit (issue 20, service/audit.py): off at rate 0; audits only learned
answers, after they were computed (never changing one already sent); learns the audited pairs
through the durable log (before they count); statistics equal to an independent computation and
the same after a clean restart and after a crash (log replay); a drift lowers the threshold and
says so; the request side never blocks."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kjit.certificates import Certificates
from kjit.oracles import QuadratureOracle
from service import create_app
from service.audit import Auditor, propose_threshold
from service.files import decode_record
from service.store import OperatorStore

from test_service_fixtures import (  # noqa: F401 - fixtures
    TOKEN,
    app_client,
    copy_store,
    load_pristine,
    pristine_store,
    probe,
    settings_for,
    store_dir,
    wait_ready,
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _body(inc, to="x"):
    return {"to": to, "incoming": {v: {"family": type(m).__name__.lower(),
                                       **{p: np.asarray(a, float).tolist() for p, a in zip(m.param_names, m.params)}}
                                   for v, m in inc.items()}}


def _audit_app(store_dir, **kw):
    base = dict(audit_rate=1.0, audit_cpu_share=1.0, audit_batch=500)
    base.update(kw)
    return create_app(settings_for(store_dir, **base))


def _records(store_dir, name="logistic-x"):
    out = []
    for p in sorted((store_dir / "operators" / name).glob("log-*.jsonl")):
        out += [decode_record(line) for line in p.read_bytes().splitlines() if line]
    return out


def test_audit_is_off_when_the_rate_is_zero(app_client, store_dir):
    assert app_client.app.state.store.audit is None
    inc = probe("logistic", 30)
    r = app_client.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc))
    assert r.status_code == 200
    d = app_client.get("/v1/operators/logistic-x").json()
    assert d["audit"]["enabled"] is False and d["audit"]["count"] == 0 and d["version"] == 0
    assert not any(t.name == "kjit-audit" for t in threading.enumerate())
    assert _records(store_dir) == []
    assert "kjit_audit_count" in app_client.get("/metrics").text  # the series exist, at 0


def test_audit_learns_durably_and_never_changes_an_answer_sent(store_dir, pristine_store):
    local = load_pristine(pristine_store, "logistic-x")
    inc = probe("logistic", 30)
    q_pristine, _ = local.operator.predict(inc)
    exact = QuadratureOracle(local.factor).belief(inc, "x")
    with TestClient(_audit_app(store_dir), headers=AUTH) as c:
        wait_ready(c)
        store = c.app.state.store
        r = c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc))
        body = r.json()
        # the answer sent is the operator's at version 0, bit for bit: the audit came after it
        assert body["version"] == 0
        np.testing.assert_array_equal(body["beliefs"]["mean"], q_pristine.mean())
        np.testing.assert_array_equal(body["beliefs"]["var"], q_pristine.var())
        assert store.audit.drain()
        d = c.get("/v1/operators/logistic-x").json()
        a = d["audit"]
        # every row audited; learned but for those below the density guard (kept out of the record)
        keep = np.flatnonzero(~local.outside_rows(inc))
        assert a["enabled"] and a["count"] == 30 and d["version"] == 1 and a["audited_pairs"] == keep.size >= 25
        # the statistics are KL[oracle || served], computed independently here
        kl = exact.kl(q_pristine)
        assert a["mean_kl"] == pytest.approx(float(np.mean(kl)), rel=1e-9)
        assert a["max_kl"] == pytest.approx(float(np.max(kl)), rel=1e-9)
        assert a["p95_kl"] == pytest.approx(float(np.quantile(kl, 0.95)), rel=1e-9)
        assert a["share_above_target"] == pytest.approx(float(np.mean(kl > 0.01)))
        conf = np.all(local.operator.predict(inc)[1] <= local.threshold, axis=1)
        assert a["confident"] == int(conf.sum())
        # in the log before it counts: one audit record with the oracle pairs it learned
        recs = _records(store_dir)
        assert [r_["kind"] for r_ in recs] == ["audit"] and recs[0]["seq"] == 1
        assert len(recs[0]["beliefs"]["mean"]) == keep.size
        # learned exactly as the record says: the next answer is the pristine operator's after
        # partial_fit of the oracle pairs
        local.operator.partial_fit({v: m[keep] for v, m in inc.items()}, exact[keep])
        r2 = c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc)).json()
        np.testing.assert_array_equal(r2["beliefs"]["mean"], local.operator.predict(inc)[0].mean())
        assert r2["version"] == 1
        assert store.audit.drain()
        m = c.get("/metrics").text
        assert 'kjit_audit_count{operator="logistic-x"} 60.0' in m
        assert 'kjit_audit_kl{operator="logistic-x",stat="p95"}' in m


def test_audit_checks_only_learned_answers(store_dir):
    inc = probe("logistic", 40, seed=5)
    with TestClient(_audit_app(store_dir), headers=AUTH) as c:
        wait_ready(c)
        body = c.post("/v1/operators/logistic-x/messages?mode=jit", json=_body(inc), headers=AUTH).json()
        n_learned = body["n"] - body["n_consulted"]
        assert 0 < n_learned < body["n"]
        # rejected input: audited nothing, changed nothing
        bad = _body(inc)
        bad["incoming"]["x"]["var"][3] = -1.0
        assert c.post("/v1/operators/logistic-x/messages?mode=predict", json=bad).status_code == 422
        c.post("/v1/operators/logistic-x/messages?mode=oracle", json=_body(inc), headers=AUTH)
        assert c.app.state.store.audit.drain()
        d = c.get("/v1/operators/logistic-x").json()
        assert d["audit"]["count"] == n_learned
        assert [r["kind"] for r in _records(store_dir)] == ["jit", "audit"]


def test_audit_statistics_survive_a_crash_and_a_restart(store_dir, tmp_path):
    inc = probe("logistic", 50, seed=9)
    with TestClient(_audit_app(store_dir, audit_batch=16), headers=AUTH) as c:
        wait_ready(c)
        for s in range(3):
            c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body({v: m[s * 15:(s + 1) * 15]
                                                                                for v, m in inc.items()}))
        assert c.app.state.store.audit.drain()
        before = c.get("/v1/operators/logistic-x").json()
        assert before["audit"]["count"] == 45 and before["version"] >= 2  # at most 16 rows per record
        # a crash now: no snapshot since the audits; the log alone rebuilds the statistics
        crashed = tmp_path / "crashed"
        copy_store(store_dir, crashed)
    st = OperatorStore(crashed)
    st.open()
    try:
        st.load_all()
        e = st.get("logistic-x")
        after_crash = e.detail()
    finally:
        st.abandon()
    with TestClient(_audit_app(store_dir, audit_rate=0.0), headers=AUTH) as c:  # a clean restart (snapshot)
        wait_ready(c)
        after = c.get("/v1/operators/logistic-x").json()
    for d in (after_crash, after):
        assert d["version"] == before["version"] and d["threshold"] == before["threshold"]
        for k in ("count", "mean_kl", "p95_kl", "max_kl", "share_above_target", "confident", "threshold_changes",
                  "histogram_log10_kl", "recent", "audited_pairs"):
            assert d["audit"][k] == before["audit"][k], k


def _set_threshold(store_dir, name, threshold):
    """Rewrite the operator's snapshot 0 with another JIT threshold (before the server starts)."""
    from kjit.persistence import dumps_state, loads_state

    path = store_dir / "operators" / name / "snapshot-00000000.npz"
    kind, state = loads_state(path.read_bytes())
    state["params"]["threshold"] = float(threshold)
    path.write_bytes(dumps_state(kind, state))


def test_drift_lowers_the_threshold_and_says_so(store_dir, pristine_store, caplog):
    inc = probe("logistic", 60, seed=2)
    local = load_pristine(pristine_store, "logistic-x")
    floor = local.threshold_floor()
    _, lv = local.operator.predict(inc)
    # a threshold above the noise floor with about half the answers confident
    _set_threshold(store_dir, "logistic-x", max(float(np.median(lv.max(axis=1))), floor + 2.0))
    with caplog.at_level(logging.WARNING, logger="kjit.service.store"):
        with TestClient(_audit_app(store_dir, audit_kl_target=1e-12, audit_min_audits=5), headers=AUTH) as c:
            wait_ready(c)
            thr0 = c.get("/v1/operators/logistic-x").json()["threshold"]
            c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc))
            assert c.app.state.store.audit.drain()
            d = c.get("/v1/operators/logistic-x").json()
            rec = [r for r in _records(store_dir) if r["kind"] == "audit"][-1]
    changes = d["audit"]["threshold_changes"]
    assert len(changes) == 1 and changes[0]["from"] == thr0 and changes[0]["to"] == d["threshold"] < thr0
    assert "drifted" in d["threshold_note"] and "lowered" in d["threshold_note"]
    assert any("threshold lowered" in r.getMessage() for r in caplog.records)
    assert rec["audit"]["threshold_change"]["to"] == d["threshold"] >= floor


def test_the_threshold_stays_above_the_noise_floor(store_dir, pristine_store):
    local = load_pristine(pristine_store, "logistic-x")
    floor = local.threshold_floor()
    _set_threshold(store_dir, "logistic-x", floor + 0.2)
    inc = probe("logistic", 200, seed=3)
    with TestClient(_audit_app(store_dir, audit_kl_target=1e-12, audit_min_audits=5), headers=AUTH) as c:
        wait_ready(c)
        for s in range(4):
            c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body({v: m[s * 50:(s + 1) * 50]
                                                                                for v, m in inc.items()}))
            assert c.app.state.store.audit.drain()
        d = c.get("/v1/operators/logistic-x").json()
    changes = d["audit"]["threshold_changes"]
    # lowered once, to the floor, and said so; never below
    assert len(changes) == 1 and changes[0]["to"] == pytest.approx(floor) and changes[0]["at_floor"]
    assert d["threshold"] == pytest.approx(floor) and "noise floor" in d["threshold_note"]


def test_propose_threshold_rule():
    rng = np.random.default_rng(0)
    u = rng.uniform(-10, -5, 200)
    kl = np.where(u > -7, 0.1, 1e-4)  # answers above log variance -7 are bad
    new, p95 = propose_threshold(u, kl, -5.0, 0.01, 20)
    assert p95 == pytest.approx(0.1) and new <= -5.5
    ok = u <= new
    assert np.quantile(kl[ok], 0.95) <= 0.01 and new >= -7.1  # the largest cut that meets the target
    assert propose_threshold(u, np.full(200, 1e-4), -5.0, 0.01, 20)[0] is None  # no drift
    assert propose_threshold(u[:10], kl[:10], -5.0, 0.01, 20)[0] is None  # too few audits
    # the vectorised prefix quantiles agree with np.quantile prefix by prefix
    kl2 = rng.lognormal(-7, 2, 200)
    new2, _ = propose_threshold(u, kl2, -5.0, 0.003, 20)
    order = np.argsort(u)
    ref = [float(u[order][i]) for i in range(4, 200) if np.quantile(kl2[order][: i + 1], 0.95) <= 0.003]
    assert new2 == pytest.approx(min(max(ref), -5.5)) if ref else new2 is not None
    # never below the floor; at the floor, no change
    assert propose_threshold(u, kl, -5.0, 0.01, 20, floor=-5.2)[0] == -5.2
    assert propose_threshold(u, kl, -5.2, 0.01, 20, floor=-5.2)[0] is None


def test_offer_never_blocks_and_drops_beyond_the_queue():
    class E:  # a stand-in entry: the offer only reads the oracle's kind
        name = "x"

        class jit:
            oracle = object()

    from kjit.families import Gaussian

    aud = Auditor(1.0, max_queue=5)  # not started: nothing drains the queue
    q = Gaussian(np.zeros(100), np.ones(100))
    cert = Certificates(["learned"] * 100, Gaussian.coord_names, log_var=np.zeros((100, 2)), threshold=1.0)
    assert aud.offer(E, {"x": q}, q, cert) == 5
    assert aud.offer(E, {"x": q}, q, cert) == 0
    s = aud.summary()
    assert s["picked"] == 200 and s["dropped"] == 195 and s["queued"] == 5
    # oracle answers are never audited
    cert_o = Certificates(["oracle"] * 100, Gaussian.coord_names)
    assert Auditor(1.0).offer(E, {"x": q}, q, cert_o) == 0


def test_bad_audit_settings_are_refused():
    from service import Settings

    for kw in ({"audit_rate": 1.5}, {"audit_rate": -0.1}, {"audit_cpu_share": 0.0}, {"audit_kl_target": 0.0}):
        with pytest.raises(ValueError, match="audit"):
            Settings(**kw)
    assert Settings.from_env({"KJIT_AUDIT_RATE": "0.05"}).audit_rate == 0.05
    assert Settings().audit_rate == 0.0



def test_cli_audit_prints_the_summary_and_a_histogram(store_dir, capsys):
    from kjit.cli import format_audit, main
    from service.testing import ThreadedServer

    inc = probe("logistic", 40, seed=4)
    with ThreadedServer(settings_for(store_dir, audit_rate=1.0, audit_cpu_share=1.0)) as srv:
        import httpx

        httpx.post(f"{srv.url}/v1/operators/logistic-x/messages?mode=predict", json=_body(inc), timeout=30,
                   headers=AUTH)
        assert srv.app.state.store.audit.drain()
        detail = httpx.get(f"{srv.url}/v1/operators/logistic-x", timeout=30).json()
        assert main(["audit", "logistic-x", "--url", srv.url]) == 0
        out = capsys.readouterr().out
        assert main(["audit", "logistic-x", "--url", srv.url, "--json"]) == 0
        js = json.loads(capsys.readouterr().out)
        assert main(["audit", "no-such-op", "--url", srv.url]) == 2
        err = capsys.readouterr().err
    assert out.strip() == format_audit(detail)
    assert "40 answers audited" in out and "log10 KL of the recent audits" in out
    counts = detail["audit"]["histogram_log10_kl"]["counts"]
    bars = [ln for ln in out.splitlines() if ln.startswith("  [")]
    assert sum(int(ln.split()[-1]) for ln in bars) == sum(counts) == 40
    assert js["audit"]["count"] == 40
    assert "404" in err and "Traceback" not in err


def test_audit_records_travel_the_shared_log_of_replicas(store_dir, tmp_path):
    """A replica's audited pairs go through the shared log like any update: another replica
    applies them (same version, same audit statistics, same predictions)."""
    import httpx

    from service.testing import ThreadedServer

    shared = str(tmp_path / "shared")
    inc = probe("logistic", 30, seed=21)
    test = probe("logistic", 20, seed=22)
    a_set = settings_for(store_dir, shared_store=shared, merge_interval=0, audit_rate=1.0, audit_cpu_share=1.0,
                         audit_batch=500)
    b_set = settings_for(tmp_path / "b-store", shared_store=shared, merge_interval=0)
    with ThreadedServer(a_set) as a, ThreadedServer(b_set) as b:
        with httpx.Client(base_url=a.url, headers=AUTH, timeout=30) as ca, \
                httpx.Client(base_url=b.url, headers=AUTH, timeout=30) as cb:
            ca.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc))
            assert a.app.state.store.audit.drain()
            da = ca.get("/v1/operators/logistic-x").json()
            assert da["audit"]["count"] == 30 and da["version"] == 1
            mb = cb.post("/v1/operators/logistic-x/merge").json()
            assert mb["merged"] == 1 and mb["version"] == 1
            db = cb.get("/v1/operators/logistic-x").json()
            for k in ("count", "mean_kl", "p95_kl", "max_kl", "recent"):
                assert db["audit"][k] == da["audit"][k], k
            assert db["audit"]["enabled"] is False  # B does not audit (its rate is 0) but knows A's audits
            pa = ca.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(test)).json()
            pb = cb.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(test)).json()
            assert pa["beliefs"] == pb["beliefs"] and pa["version"] == pb["version"] == 1


def test_threshold_floor_is_where_the_oracle_would_answer_everything(pristine_store):
    import copy

    local = load_pristine(pristine_store, "logistic-x")
    op = local.operator
    floor = local.threshold_floor()
    assert floor == pytest.approx(float(np.max(np.log(2 * op.noise_var_ * op.y_scale_ ** 2))))
    inc = probe("logistic", 40, seed=31)
    below = copy.deepcopy(local)
    below.threshold = float(np.max(np.log(op.noise_var_ * op.y_scale_ ** 2))) - 1e-6  # under the noise alone
    assert below.predict(inc)[2].all()  # every row consulted
    above = copy.deepcopy(local)
    above.threshold = floor + 3.0
    assert not above.predict(inc)[2].all()


def test_metrics_scrape_while_audits_are_folded():
    """/metrics (AuditCollector.collect) reads an operator's audit statistics while the audit
    worker folds new records into them (under the operator's exclusive lock): the scrape must not
    iterate the statistics' deques while they change ("deque mutated during iteration")."""
    import sys
    import types

    from service.audit import RECENT, AuditCollector, AuditStats
    from service.locks import RWLock

    stats = AuditStats()
    entry = types.SimpleNamespace(audit_stats=stats, jit=types.SimpleNamespace(threshold=-3.0), lock=RWLock())
    store = types.SimpleNamespace(entries={"op": entry}, audit=None)
    rec = {"kl": [1e-3] * 50, "confident": [True] * 50, "log_var": [-5.0] * 50, "target": 0.01, "time": 1.0}
    for v in range(RECENT // 50):
        stats.fold(rec, v)
    stop = threading.Event()
    errors = []

    def fold():
        v = 100
        while not stop.is_set():
            with entry.lock.write():  # as Entry._account does, via audit_update
                stats.fold(rec, v)
            v += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=fold)
    t.start()
    try:
        collector = AuditCollector(store)
        for _ in range(300):
            try:
                list(collector.collect())
            except RuntimeError as exc:
                errors.append(exc)
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert not errors, errors


# ------------------------------------------------------------------------------ found by an audit (session 21)
def test_a_request_without_the_token_is_not_audited(store_dir):
    """With a token configured, mode=predict is open to all because it changes nothing — but its rows fed
    the audit, which learns them and may lower the threshold: an unauthenticated client moved the
    operator's version, training set and threshold.  Its rows are not audited now; the token's are."""
    inc = probe("logistic", 30)
    with TestClient(_audit_app(store_dir)) as c:
        wait_ready(c)
        store = c.app.state.store
        assert c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc)).status_code == 200
        wrong = {"Authorization": "Bearer not-the-token"}
        assert c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc), headers=wrong).status_code == 200
        assert store.audit.drain()
        d = c.get("/v1/operators/logistic-x").json()
        assert d["version"] == 0 and d["audit"]["count"] == 0 and d["audit"]["server"]["picked"] == 0
        assert _records(store_dir) == []
        assert c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc), headers=AUTH).status_code == 200
        assert store.audit.drain()
        d = c.get("/v1/operators/logistic-x").json()
        assert d["version"] == 1 and d["audit"]["count"] == 30


def test_a_refused_predict_request_is_not_audited(store_dir, monkeypatch):
    """A mode=predict answer the route refuses (a row whose belief or log variance is not finite: 422 naming
    it) was offered to the audit first, which then learned every row of it — a 4xx that changed the version
    and the training set (found by a hostile-input audit; the non-finite row injected, as a user factor's
    could give one).  Refused answers are not offered; the same request without the bad row is."""
    import kjit.learn.jit as jit_module
    orig = jit_module.JITOperator.screen_certified

    def last_row_overflows(self, incoming, to=None, version=None):
        q, cert, unc = orig(self, incoming, to, version)
        lv = np.array(cert.log_var, float)
        lv[-1] = np.inf
        return q, cert.with_(log_var=lv), unc

    inc = probe("logistic", 3)
    with TestClient(_audit_app(store_dir), headers=AUTH) as c:
        wait_ready(c)
        store = c.app.state.store
        with monkeypatch.context() as m:
            m.setattr(jit_module.JITOperator, "screen_certified", last_row_overflows)
            r = c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "incoming", 2], r.text
        assert store.audit.drain()
        d = c.get("/v1/operators/logistic-x").json()
        assert d["version"] == 0 and d["audit"]["count"] == 0 and d["audit"]["server"]["offered"] == 0
        assert _records(store_dir) == []
        assert c.post("/v1/operators/logistic-x/messages?mode=predict", json=_body(inc)).status_code == 200
        assert store.audit.drain()
        assert c.get("/v1/operators/logistic-x").json()["audit"]["count"] == 3


def test_one_refused_row_does_not_sink_its_audit_batch(store_dir):
    """The oracle's refusal of one row (naming it) failed the whole batch — other clients' rows too, so a
    row sent every second blinded the audit.  The named rows are counted as failed, the others audited."""
    from kjit.families import Gaussian

    good = probe("logistic", 40, seed=11)
    bad = {"x": Gaussian(np.array([3.0]), np.array([1e-11])), "z": probe("logistic", 1, seed=12)["z"]}
    with TestClient(_audit_app(store_dir), headers=AUTH) as c:
        wait_ready(c)
        store = c.app.state.store
        store.audit.linger = 5.0  # (both requests in one batch)
        for inc in (good, bad):
            assert c.post("/v1/operators/logistic-z/messages?mode=predict", json=_body(inc, "z")).status_code == 200
        assert store.audit.drain()
        a = c.get("/v1/operators/logistic-z").json()["audit"]
        assert a["count"] == 40 and a["server"]["failed"] == 1 and a["records"] == 1


def test_an_audit_record_holds_at_most_the_batch(store_dir):
    """KJIT_AUDIT_BATCH bounds the rows a record learns under the operator's exclusive lock: a 10-row then
    a 300-row request made one record of 310 rows at batch 16."""
    with TestClient(_audit_app(store_dir, audit_batch=16), headers=AUTH) as c:
        wait_ready(c)
        store = c.app.state.store
        for n, seed in ((10, 1), (300, 2)):
            assert c.post("/v1/operators/logistic-x/messages?mode=predict",
                          json=_body(probe("logistic", n, seed=seed))).status_code == 200
        assert store.audit.drain()
        sizes = [len(r["audit"]["kl"]) for r in _records(store_dir) if "audit" in r]
        assert sum(sizes) == 310 and max(sizes) <= 16


def _direct_store(store_dir, **kw):
    from service.audit import Auditor
    from service.store import OperatorStore

    st = OperatorStore(store_dir)
    st.audit = Auditor(1.0, cpu_share=1.0, batch=1000, seed=0, **kw)  # (not started: batches run by hand)
    st.open()
    st.load_all()
    return st


def test_audited_rows_are_credited_to_the_version_that_served_them(store_dir):
    """recent.version was the audit record's own number (the state after the audit learned, plus whatever
    landed while the rows waited), not the version that served them."""
    from kjit.oracles import QuadratureOracle

    st = _direct_store(store_dir)
    try:
        e = st.get("logistic-x")
        cert = e.predict_certified(probe("logistic", 10, seed=1), "predict")[5]
        for s in (2, 3):
            o = probe("logistic", 5, seed=s)
            e.observe(o, QuadratureOracle(e.jit.factor).belief(o, "x"), None, None)
        assert e.version == 2 and cert.version == 0
        st.audit._audit([st.audit._q.get_nowait()])
        assert e.version == 3
        assert set(e.detail()["audit"]["recent"]["version"]) == {0}
    finally:
        st.abandon()


def test_the_drift_window_holds_answers_confident_under_the_threshold_in_force(store_dir):
    """Rows served as confident under an older, higher threshold entered the window after the audit had
    lowered it, and lowered it again on answers the new threshold would not give as confident."""
    from service.audit import AuditStats

    st = _direct_store(store_dir, kl_target=1e-3, min_audits=5)
    try:
        e = st.get("logistic-x")
        u = np.linspace(-14.0, -9.0, 40)                   # log variances: served under a threshold of −8
        kl = np.where(u > -12.0, 1.0, 1e-6)                # wrong exactly where they would be uncertain now
        confident = np.ones(40, dtype=bool)
        payload = st.audit._payload(e, AuditStats(), -12.0, kl, u, confident)
        np.testing.assert_array_equal(payload["in_window"], u <= -12.0)
        assert "threshold_change" not in payload           # the window's answers meet the target
        # (and the record folds to the same window on replay)
        stats = AuditStats()
        stats.fold(payload, 7)
        assert len(stats.window) == int(np.sum(u <= -12.0))
    finally:
        st.abandon()


def test_the_audit_counts_each_row_once_when_its_record_cannot_be_written(store_dir, monkeypatch):
    """A batch with one refused row whose record then failed (disk full, an unreachable shared store)
    counted that row as failed twice: picked 41, failed 42 (found in review).  picked = audited +
    dropped + queued + failed holds."""
    from kjit.families import Gaussian

    good = probe("logistic", 40, seed=11)
    bad = {"x": Gaussian(np.array([3.0]), np.array([1e-11])), "z": probe("logistic", 1, seed=12)["z"]}
    with TestClient(_audit_app(store_dir), headers=AUTH) as c:
        wait_ready(c)
        st = c.app.state.store
        st.audit.linger = 5.0
        e = st.get("logistic-z")

        def boom(*a, **k):
            raise OSError("disk full")

        monkeypatch.setattr(e, "audit_update", boom)
        for inc in (good, bad):
            assert c.post("/v1/operators/logistic-z/messages?mode=predict", json=_body(inc, "z")).status_code == 200
        assert st.audit.drain()
        s = st.audit.summary()
        audited = sum(x.audit_stats.count for x in st.entries.values())
        assert s["picked"] == 41 and s["failed"] == 41 and audited == 0
        assert s["picked"] == audited + s["dropped"] + s["queued"] + s["failed"]
