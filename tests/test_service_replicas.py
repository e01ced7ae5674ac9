"""Replicas: several servers serving the same operators through a shared update log
(service.shared), with a directory and with a real Redis server (Debian's redis-server, started
here on a free loopback port) as the shared store.

The contract under test: every replica's operator is the shared base plus the first ``version``
records of the shared log in log order, so after a merge replicas predict bit for bit like one
operator that saw every update exactly once, in that order; Idempotency-Key retries count once
across replicas; a restarted replica catches up."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import httpx
import numpy as np
import pytest

from kjit.factors import Logistic
from kjit.families import Gaussian
from kjit.oracles import QuadratureOracle
from service.shared import DirectorySharedLog, open_shared
from service.store import encode_record
from service.testing import SubprocessServer, ThreadedServer, free_port

from test_service_fixtures import (  # noqa: F401 - fixtures
    TOKEN,
    copy_store,
    load_pristine,
    poll,
    pristine_store,
    probe,
    settings_for,
    store_dir,
)
from test_service import AUTH, beliefs_body, body

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")


# ------------------------------------------------------------------------------ Redis
def _redis_server_binary():
    path = shutil.which("redis-server")
    if path is None:
        if os.environ.get("KJIT_REQUIRE_REDIS"):
            pytest.fail("redis-server is required (KJIT_REQUIRE_REDIS is set) but not installed")
        pytest.skip("redis-server not installed (apt-get install redis-server); CI installs it")
    try:
        import redis  # noqa: F401
    except ImportError:
        if os.environ.get("KJIT_REQUIRE_REDIS"):
            pytest.fail("the redis package is required (KJIT_REQUIRE_REDIS is set): pip install 'kjit[redis]'")
        pytest.skip("the redis package is not installed (kjit[redis])")
    return path


@pytest.fixture
def redis_url(tmp_path):
    """A durable Redis (appendonly, fsync on every write) on a free loopback port, for this test."""
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()
    proc = _start_redis(port, data)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _start_redis(port: int, data):
    """A durable redis-server (appendonly, fsync on every write) on ``port`` with its files in ``data``,
    once it answers PING."""
    binary = _redis_server_binary()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
                             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                             "--protected-mode", "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t_end = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > t_end:
            proc.kill()
            raise RuntimeError("redis-server did not start: " + proc.stdout.read().decode(errors="replace"))
        time.sleep(0.05)


@pytest.fixture(params=["directory", "redis"])
def shared_url(request, tmp_path):
    if request.param == "directory":
        return str(tmp_path / "shared")
    return request.getfixturevalue("redis_url")


# ------------------------------------------------------------------------------ helpers
def _oracle_pairs(n_batches, rows, seed):
    oracle = QuadratureOracle(Logistic())
    out = []
    for i in range(n_batches):
        inc = probe("logistic", rows, seed=seed + i)
        out.append((inc, oracle.belief(inc, "x")))
    return out


def _observe(c, inc, q, key=None):
    headers = {"Idempotency-Key": key} if key else {}
    r = c.post("/v1/operators/logistic-x/observations", headers=headers,
               json={"incoming": body(inc, "x")["incoming"], "beliefs": beliefs_body(q)})
    assert r.status_code == 200, r.text
    return r.json()


def _learn(jit, inc, q):
    """What the server learns of (inc, q): the pairs above the operator's density guard (the rest are
    acknowledged, not learned: JITOperator.outside_rows)."""
    keep = np.flatnonzero(~jit.outside_rows(inc))
    if keep.size:
        jit.operator.partial_fit({v: m[keep] for v, m in inc.items()}, q[keep])


def _predict(c, inc):
    r = c.post("/v1/operators/logistic-x/messages?mode=predict", json=body(inc, "x"))
    assert r.status_code == 200, r.text
    return r.json()


def _replica(store, shared, **kw):
    kw.setdefault("merge_interval", 0)  # merges only when asked (and before each update): deterministic
    return ThreadedServer(settings_for(store, shared_store=shared, **kw))


# ------------------------------------------------------------------------------ the contract
def test_two_replicas_interleaved_updates_merge_to_one_operator(store_dir, pristine_store, tmp_path, shared_url):
    """Replica A starts from a store with the operators, replica B from an empty store (it adopts
    them from the shared store).  Observations and jit requests go to A and B alternately; after
    a merge both predict bit for bit like the pristine operator that learned every update once,
    in the order of the versions the replicas acknowledged."""
    empty = tmp_path / "b-store"
    pairs = _oracle_pairs(8, rows=3, seed=500)
    jit_batches = [probe("logistic", 20, seed=900 + i) for i in range(4)]
    updates = {}  # version -> (incoming, beliefs) learned at that position of the shared log
    with _replica(store_dir, shared_url) as a, _replica(empty, shared_url) as b:
        ca = httpx.Client(base_url=a.url, headers=AUTH, timeout=30)
        cb = httpx.Client(base_url=b.url, headers=AUTH, timeout=30)
        with ca, cb:
            assert cb.get("/ready").json()["operators"] == ["compound_gamma-tau", "logistic-x", "logistic-z"]
            for i, (inc, q) in enumerate(pairs):
                c = (ca, cb)[i % 2]
                r = _observe(c, inc, q)
                assert r["accepted"] + r["not_learned"] == 3 and not r["duplicate"]
                updates[r["version"]] = (inc, q)
                if i % 2 == 1:  # a jit request too; the oracle's answers are learned through the log
                    inc_j = jit_batches[i // 2]
                    rj = (ca, cb)[(i // 2) % 2].post("/v1/operators/logistic-x/messages?mode=jit",
                                                     json=body(inc_j, "x"))
                    assert rj.status_code == 200, rj.text
                    rj = rj.json()
                    cons = np.array(rj["consulted"])
                    if cons.any():
                        idx = np.flatnonzero(cons)
                        q_j = Gaussian(np.array(rj["beliefs"]["mean"])[idx], np.array(rj["beliefs"]["var"])[idx])
                        updates[rj["version"]] = ({v: m[idx] for v, m in inc_j.items()}, q_j)
            n = len(updates)
            assert sorted(updates) == list(range(1, n + 1)), "versions are the shared log's positions, no gaps"
            assert n > len(pairs), "some jit rows should have been consulted"
            # before a merge B is behind A (it has not seen A's last update)
            ma = ca.post("/v1/operators/logistic-x/merge").json()
            mb = cb.post("/v1/operators/logistic-x/merge").json()
            assert ma["version"] == mb["version"] == ma["shared_length"] == n
            assert ma["merged"] + mb["merged"] >= 1
            test = probe("logistic", 60, seed=4242)
            pa, pb = _predict(ca, test), _predict(cb, test)
            assert pa["version"] == pb["version"] == n
            assert pa["beliefs"] == pb["beliefs"] and pa["log_var"] == pb["log_var"]  # bit for bit
            da, db = ca.get("/v1/operators/logistic-x").json(), cb.get("/v1/operators/logistic-x").json()
            assert da["n_train"] == db["n_train"]
            assert da["replication"]["base_sha256"] == db["replication"]["base_sha256"]

    # one operator that saw every update exactly once, in log order
    local = load_pristine(pristine_store, "logistic-x")
    for v in sorted(updates):
        _learn(local, *updates[v])
    assert local.operator.n_train_ == da["n_train"]
    q_loc, lv_loc = local.operator.predict(test)
    np.testing.assert_array_equal(pa["beliefs"]["mean"], q_loc.mean())
    np.testing.assert_array_equal(pa["beliefs"]["var"], q_loc.var())
    np.testing.assert_array_equal(np.transpose(pa["log_var"]), local.screen_certified(test)[1].log_var)
    # and it differs from the operator without B's updates (the test can fail)
    skip = load_pristine(pristine_store, "logistic-x")
    for v in sorted(updates)[:-1]:
        _learn(skip, *updates[v])
    assert not np.array_equal(skip.operator.predict(test)[0].mean(), q_loc.mean())


def test_concurrent_writers_on_two_replicas_get_one_order(store_dir, pristine_store, tmp_path, shared_url):
    """Two clients stream observations to two replicas at the same time: the compare-and-set
    append gives every update its own place in one order, and both replicas end at exactly the
    operator that learned them in that order."""
    import threading

    pairs = _oracle_pairs(24, rows=2, seed=1200)
    acked = {}
    errors = []
    with _replica(store_dir, shared_url) as a, _replica(tmp_path / "b", shared_url) as b:
        def stream(url, part):
            try:
                with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
                    for i in part:
                        acked[_observe(c, *pairs[i])["version"]] = i
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        ts = [threading.Thread(target=stream, args=(a.url, range(0, 24, 2))),
              threading.Thread(target=stream, args=(b.url, range(1, 24, 2)))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        assert not errors, errors
        assert sorted(acked) == list(range(1, 25)) and sorted(acked.values()) == list(range(24))
        test = probe("logistic", 30, seed=8)
        out = []
        for srv in (a, b):
            with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
                assert c.post("/v1/operators/logistic-x/merge").json()["version"] == 24
                out.append(_predict(c, test))
    assert out[0]["beliefs"] == out[1]["beliefs"]
    local = load_pristine(pristine_store, "logistic-x")
    for v in range(1, 25):
        _learn(local, *pairs[acked[v]])
    np.testing.assert_array_equal(out[0]["beliefs"]["mean"], local.operator.predict(test)[0].mean())


def test_idempotency_key_counts_once_across_replicas(store_dir, tmp_path, shared_url):
    (inc, q), (inc2, q2) = _oracle_pairs(2, rows=4, seed=70)
    with _replica(store_dir, shared_url) as a, _replica(tmp_path / "b", shared_url) as b:
        with httpx.Client(base_url=a.url, headers=AUTH, timeout=60) as ca, httpx.Client(base_url=b.url, headers=AUTH, timeout=60) as cb:
            r1 = _observe(ca, inc, q, key="key-1")
            r2 = _observe(cb, inc, q, key="key-1")  # the client retried on the other replica
            assert r2["duplicate"] and r2["version"] == r1["version"] and r2["accepted"] == 4
            assert r2["n_train"] == r1["n_train"] == 304
            r3 = cb.post("/v1/operators/logistic-x/observations", headers={"Idempotency-Key": "key-1"},
                         json={"incoming": body(inc2, "x")["incoming"], "beliefs": beliefs_body(q2)})
            assert r3.status_code == 409 and r3.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
            assert ca.post("/v1/operators/logistic-x/merge").json()["version"] == 1


def test_background_merge_and_restarted_replica_catches_up(store_dir, tmp_path):
    shared = str(tmp_path / "shared")
    pairs = _oracle_pairs(6, rows=2, seed=300)
    b_store = tmp_path / "b"
    with _replica(store_dir, shared, merge_interval=0.05) as a:
        with httpx.Client(base_url=a.url, headers=AUTH, timeout=60) as ca:
            with _replica(b_store, shared, merge_interval=0.05) as b:
                with httpx.Client(base_url=b.url, headers=AUTH, timeout=60) as cb:
                    _observe(ca, *pairs[0])
                    t_end = time.monotonic() + 120
                    while cb.get("/v1/operators/logistic-x").json()["version"] < 1:  # merged in the background
                        assert time.monotonic() < t_end, "replica B never merged A's update"
                        time.sleep(0.02)
            for inc, q in pairs[1:]:  # B is down
                _observe(ca, inc, q)
            with _replica(b_store, shared) as b2, httpx.Client(base_url=b2.url, headers=AUTH, timeout=60) as cb:
                test = probe("logistic", 30, seed=31)
                pa, pb = _predict(ca, test), _predict(cb, test)
                assert pa["version"] == pb["version"] == 6  # caught up on start
                assert pa["beliefs"] == pb["beliefs"] and pa["log_var"] == pb["log_var"]


def test_an_operator_published_later_is_adopted_on_first_use(store_dir, tmp_path):
    """Replica B starts before anything is published (and never merges in the background): the
    first request naming A's operator adopts it from the shared store."""
    shared = str(tmp_path / "shared")
    with _replica(tmp_path / "b", shared) as b, httpx.Client(base_url=b.url, headers=AUTH, timeout=60) as cb:
        assert cb.get("/ready").json()["operators"] == []
        assert cb.get("/v1/operators/logistic-x").status_code == 404
        with _replica(store_dir, shared) as a, httpx.Client(base_url=a.url, headers=AUTH, timeout=60) as ca:
            (inc, q), = _oracle_pairs(1, rows=2, seed=11)
            _observe(ca, inc, q)
            r = cb.post("/v1/operators/logistic-x/merge")
            assert r.status_code == 200 and r.json()["version"] == 1, r.text
            test = probe("logistic", 10, seed=12)
            assert _predict(ca, test)["beliefs"] == _predict(cb, test)["beliefs"]
            assert cb.get("/v1/operators/nope").status_code == 404


def test_a_standalone_store_with_updates_does_not_silently_lose_them(store_dir, pristine_store, tmp_path):
    """A store that learned updates standalone, joining a shared store that already has another
    copy of the operator, refuses that operator (failed in /ready, with the reason) instead of
    dropping the updates; with no copy in the shared store it publishes its state, updates kept."""
    (inc, q), = _oracle_pairs(1, rows=3, seed=21)
    with ThreadedServer(settings_for(store_dir)) as s, httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        assert _observe(c, inc, q)["version"] == 1
    other = tmp_path / "other"
    copy_store(pristine_store, other)
    shared = str(tmp_path / "shared")
    with _replica(other, shared):
        pass  # publishes the pristine operators
    srv = _replica(store_dir, shared).start(ready=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            t_end = time.monotonic() + 120
            while (r := c.get("/ready").json())["loading"] and time.monotonic() < t_end:
                time.sleep(0.05)
            assert "logistic-x" in r["failed"] and "outside the shared store" in r["failed"]["logistic-x"]
            assert "logistic-z" in r["operators"]  # untouched operators are adopted as usual
    finally:
        srv.stop()
    fresh = str(tmp_path / "shared2")
    with _replica(store_dir, fresh) as s, httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        d = c.get("/v1/operators/logistic-x").json()
        assert d["n_train"] == 303 and d["version"] == 0  # the learned pairs are in the published base
        before = c.post("/v1/operators/logistic-x/messages?mode=predict", json=body(inc, "x")).json()
    # restarted before any update, it loads the base it published (found in review: it loaded its
    # standalone snapshot again, which the shared store then refused as another copy)
    with _replica(store_dir, fresh) as s, httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        assert c.get("/ready").json()["failed"] == {}
        again = c.post("/v1/operators/logistic-x/messages?mode=predict", json=body(inc, "x")).json()
        assert again["version"] == 0 and again["beliefs"] == before["beliefs"]


def test_merge_without_a_shared_store_is_409(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.post("/v1/operators/logistic-x/merge").status_code == 401  # state-changing: token first
        r = c.post("/v1/operators/logistic-x/merge", headers=AUTH)
        assert r.status_code == 409 and r.json()["detail"][0]["type"] == "not_replicated"


@pytest.fixture
def live(store_dir):
    with ThreadedServer(settings_for(store_dir)) as srv:
        yield srv


# ------------------------------------------------------------------------------ the shared logs themselves
def _rec(i):
    return encode_record({"seq": i, "x": "y" * i})


def test_shared_log_compare_and_set_and_read(tmp_path, shared_url):
    log = open_shared(shared_url)
    try:
        assert log.get_base("op") is None
        assert log.publish_base("op", b"first") == b"first"
        assert log.publish_base("op", b"second") == b"first"  # put-if-absent: the first publisher wins
        assert "op" in log.names()
        assert log.append("op", 0, _rec(1))
        assert not log.append("op", 0, _rec(1))  # someone appended first: refused
        assert log.append("op", 1, _rec(2)) and log.append("op", 2, _rec(3))
        assert not log.append("op", 5, _rec(6))
        assert log.length("op") == 3
        assert [r.rstrip(b"\n") for r in log.read("op", 1)] == [_rec(2).rstrip(b"\n"), _rec(3).rstrip(b"\n")]
        assert log.read("op", 3) == []
        # a second client (another replica) sees the same log
        other = open_shared(shared_url)
        assert other.length("op") == 3 and not other.append("op", 2, _rec(3)) and other.append("op", 3, _rec(4))
        assert log.length("op") == 4 and log.read("op", 3)[0].rstrip(b"\n") == _rec(4).rstrip(b"\n")
        other.close()
    finally:
        log.close()


def test_directory_log_cuts_a_torn_record_of_a_dead_writer(tmp_path):
    log = DirectorySharedLog(tmp_path / "s")
    assert log.append("op", 0, _rec(1))
    with open(tmp_path / "s" / "op" / "log.jsonl", "ab") as fh:
        fh.write(_rec(2)[:7])  # a writer died half-way (never acknowledged)
    fresh = DirectorySharedLog(tmp_path / "s")
    assert fresh.length("op") == 1 and len(fresh.read("op", 0)) == 1  # readers ignore the torn tail
    assert fresh.append("op", 1, _rec(2))  # the next writer cuts it and appends
    assert [r.rstrip(b"\n") for r in DirectorySharedLog(tmp_path / "s").read("op", 0)] == \
        [_rec(1).rstrip(b"\n"), _rec(2).rstrip(b"\n")]


def test_directory_log_keeps_a_record_that_lost_only_its_newline(tmp_path):
    """A last record whole but for its newline passes its check: the next writer restores the newline and appends
    after it (it cut the record as torn: an acknowledged update lost after a one-byte truncation — audit)."""
    log = DirectorySharedLog(tmp_path / "s")
    assert log.append("op", 0, _rec(1)) and log.append("op", 1, _rec(2))
    p = tmp_path / "s" / "op" / "log.jsonl"
    p.write_bytes(p.read_bytes()[:-1])
    fresh = DirectorySharedLog(tmp_path / "s")
    assert not fresh.append("op", 1, _rec(2))  # (it holds 2 records: an append expecting 1 loses the race)
    assert fresh.append("op", 2, _rec(3))
    assert [r.rstrip(b"\n") for r in DirectorySharedLog(tmp_path / "s").read("op", 0)] == \
        [_rec(i).rstrip(b"\n") for i in (1, 2, 3)]


def test_open_shared_rejects_unknown_schemes():
    with pytest.raises(ValueError, match="unknown scheme"):
        open_shared("ftp://example.org/x")


# ------------------------------------------------------------------------------ real processes
def test_two_kjit_serve_processes_share_redis(store_dir, pristine_store, tmp_path, redis_url):
    """Two `kjit serve` processes (python -m service) on their own loopback ports and stores,
    one Redis: interleaved observations, a merge, equal bit-for-bit predictions."""
    env = {"KJIT_TOKEN": TOKEN, "KJIT_SHARED_STORE": redis_url, "KJIT_MERGE_INTERVAL": "0"}
    pairs = _oracle_pairs(6, rows=2, seed=800)
    with SubprocessServer(store_dir, env=env) as a, SubprocessServer(tmp_path / "b", env=env) as b:
        assert a.url != b.url
        with httpx.Client(base_url=a.url, headers=AUTH, timeout=60) as ca, httpx.Client(base_url=b.url, headers=AUTH, timeout=60) as cb:
            versions = [_observe((ca, cb)[i % 2], inc, q)["version"] for i, (inc, q) in enumerate(pairs)]
            assert versions == list(range(1, 7))
            for c in (ca, cb):
                assert c.post("/v1/operators/logistic-x/merge").json()["version"] == 6
            test = probe("logistic", 40, seed=5)
            pa, pb = _predict(ca, test), _predict(cb, test)
            assert pa["beliefs"] == pb["beliefs"] and pa["log_var"] == pb["log_var"]
    local = load_pristine(pristine_store, "logistic-x")
    for inc, q in pairs:
        _learn(local, inc, q)
    np.testing.assert_array_equal(pa["beliefs"]["mean"], local.operator.predict(test)[0].mean())


def test_a_shared_log_that_lost_records_answers_503_and_fails_the_operator(store_dir, tmp_path):
    """A shared log reset under a replica (a Redis restarted without its append-only file, here the
    directory log emptied): the request that finds it gets 503 and the operator is reported failed —
    not a 500 (found in review: update_failed / internal_error)."""
    shared = str(tmp_path / "shared")
    pairs = _oracle_pairs(3, rows=2, seed=31)
    with _replica(store_dir, shared) as s, httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c:
        for inc, q in pairs[:2]:
            _observe(c, inc, q)
        (tmp_path / "shared" / "logistic-x" / "log.jsonl").write_bytes(b"")  # the records are gone
        inc, q = pairs[2]
        r = c.post("/v1/operators/logistic-x/observations",
                   json={"incoming": body(inc, "x")["incoming"], "beliefs": beliefs_body(q)})
        assert r.status_code == 503 and "fewer than 2 records" in r.text, r.text
        assert "logistic-x" in c.get("/ready").json()["failed"]
        j = c.post("/v1/operators/logistic-x/messages?mode=jit", json=body(inc, "x"))
        assert j.status_code == 503, j.text


def test_publishing_the_base_starts_its_audit_statistics_from_zero_and_snapshots_it(tmp_path):
    """Version 0 of a shared log is the base, which carries no audit statistics: the replica that
    published it keeps none either (as every replica that adopts it), and its local snapshot is the
    base (found in review: 40 audits on one replica, 0 on the other, at the same version)."""
    from test_service_fixtures import small_store

    store = small_store(tmp_path / "store", "lx", "logistic", "x", n=200, n_inner=40, n_outer=80)
    e = store.get("lx")
    inc = probe("logistic", 3, seed=5)
    e.audit_update(inc, QuadratureOracle(Logistic()).belief(inc, "x"), lambda stats, threshold: {
        "kl": [1e-6] * 3, "log_var": [-5.0] * 3, "confident": [True] * 3, "target": 0.1, "time": 0.0})
    assert e.audit_stats.count == 3 and e.audited_pairs == 3 and e.version == 1
    e.restart_at_base(e.base_blob())
    assert e.audit_stats.count == 0 and e.audited_pairs == 0 and e.version == 0
    snaps = sorted((tmp_path / "store" / "operators" / "lx").glob("snapshot-*.npz"))
    logs = sorted((tmp_path / "store" / "operators" / "lx").glob("log-*.jsonl"))
    assert len(snaps) == 1 and snaps[0].name == "snapshot-00000001.npz" and [p.name for p in logs] == ["log-00000001.jsonl"]
    store.close()


def test_a_replica_started_while_redis_is_away_comes_up_and_waits_for_it(store_dir, tmp_path):
    """Found by an audit: a replica (re)started while Redis was briefly unreachable exited ("cannot
    reach the shared store") and stayed down.  Now it starts, answers 503 while its operators wait
    for the shared store, and serves them once Redis is back — with what was acknowledged before."""
    port, data = free_port(), tmp_path / "redis"
    data.mkdir()

    def start_redis():
        return _start_redis(port, data)

    url = f"redis://127.0.0.1:{port}/0"
    redis_proc = start_redis()
    inc, q = _oracle_pairs(1, rows=2, seed=900)[0]
    try:
        with _replica(store_dir, url) as a, httpx.Client(base_url=a.url, headers=AUTH, timeout=60) as c:
            poll(lambda: c.get("/ready"), lambda r: r.status_code == 200, timeout=120)
            r = c.post("/v1/operators/logistic-x/observations", headers={"Idempotency-Key": "k-900"},
                       json={"incoming": body(inc, "x")["incoming"], "beliefs": beliefs_body(q)})
            assert r.status_code == 200
            acked = r.json()["version"]
        redis_proc.terminate()
        redis_proc.wait(timeout=20)
        # (background merges, as by default: they retry what waits for the shared store)
        with _replica(store_dir, url, merge_interval=0.2).start(ready=False) as a, \
                httpx.Client(base_url=a.url, headers=AUTH, timeout=60) as c:
            time.sleep(1.0)  # (its load has run, and met the missing shared store)
            r = c.get("/ready")
            assert r.status_code == 503  # up, and waiting for the shared store
            redis_proc = start_redis()  # (the same data: the acknowledged record is in its append-only file)
            poll(lambda: c.get("/ready"), lambda r: r.status_code == 200, timeout=120)
            p = c.post("/v1/operators/logistic-x/messages?mode=predict", json=body(inc, "x"))
            assert p.status_code == 200 and p.json()["version"] >= acked
            again = c.post("/v1/operators/logistic-x/observations", headers={"Idempotency-Key": "k-900"},
                           json={"incoming": body(inc, "x")["incoming"], "beliefs": beliefs_body(q)})
            assert again.status_code == 200 and again.json()["duplicate"]
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=20)
