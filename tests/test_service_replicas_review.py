"""Review of the replicas (service.shared, the shared paths of service.store): failure modes and
races, mostly at the store level (OperatorStore with a shared log, no HTTP) so that the
interleavings can be forced deterministically.

Each test here first demonstrated a bug found in review (fixed since) or pins behaviour that
was checked to work."""

from __future__ import annotations

import errno
import shutil
import threading

import numpy as np
import pytest

from service.shared import DirectorySharedLog, SharedLogError, open_shared
from service.store import Conflict, NotReady, OperatorStore, PersistError

from test_service_fixtures import (  # noqa: F401 - fixtures
    load_pristine,
    pristine_store,
    probe,
    store_dir,
)
from test_service_replicas import _oracle_pairs, redis_url  # noqa: F401 - fixture

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")

NAME = "logistic-x"


# ------------------------------------------------------------------------------ helpers
def _open(root, shared, **kw):
    """A replica at the store level: its own store directory, the given shared log, no merge thread."""
    kw.setdefault("merge_interval", 0)
    kw.setdefault("snapshot_every", 1000)
    store = OperatorStore(root, shared=shared, **kw)
    store.open()
    store.load_all()
    return store


def _observe(store, inc, q, key=None):
    """(version, accepted, duplicate)"""
    return store.get(NAME).observe(inc, q, key, "h-" + key if key else None)[:3]


def _predict(store, test):
    q, logvar, _, version, _ = store.get(NAME).predict(test, "predict")
    return q.mean(), q.var(), logvar, version


def _same_prediction(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3]))


def _merged_alike(a, b, test, version):
    """B merges the shared log: both replicas then predict ``test`` bit for bit alike, at ``version``."""
    b.get(NAME).merge()
    pa, pb = _predict(a, test), _predict(b, test)
    assert pa[3] == pb[3] == version and _same_prediction(pa, pb)


# ------------------------------------------------------------------------------ the log shorter than the version
def test_update_when_shared_log_lost_its_tail_fails_instead_of_spinning(store_dir, tmp_path):
    """The shared log loses records this replica already applied (a Redis restarted without
    ``appendfsync always`` — which the code accepts with a warning — a flushed key, an evicted
    key under ``maxmemory``, a restored directory).  ``Replicated.join`` detects this on start, but a
    running replica's next update retries the compare-and-set forever: ``Replicated.catch_up`` reads
    nothing after ``version``, ``append(expected=version)`` is refused, again and again, with
    the operator's write lock held (every prediction on the operator blocks behind it)."""
    shared = DirectorySharedLog(tmp_path / "shared")
    a = _open(store_dir, shared)
    try:
        pairs = _oracle_pairs(3, rows=2, seed=11)
        for inc, q in pairs[:2]:
            _observe(a, inc, q)
        assert a.get(NAME).version == 2
        logf = tmp_path / "shared" / NAME / "log.jsonl"
        first = logf.read_bytes().split(b"\n")[0] + b"\n"
        logf.write_bytes(first)  # the shared store lost record 2

        calls = []
        real_append = shared.append

        def counting_append(name, expected, record):
            calls.append(expected)
            if len(calls) > 50:
                raise RuntimeError("spinning: the compare-and-set was refused 50 times in a row")
            return real_append(name, expected, record)

        shared.append = counting_append
        with pytest.raises(Exception) as info:
            _observe(a, *pairs[2])
        assert "spinning" not in str(info.value), "the update retried the compare-and-set without end"
        assert len(calls) <= 2
    finally:
        a.abandon()


# ------------------------------------------------------------------------------ directory log: readers without the lock
def test_directory_reader_never_applies_a_record_the_writer_retracts(store_dir, tmp_path, monkeypatch):
    """Replica A appends a record; its fsync fails, so ``append_durably`` cuts the record off
    again and A answers 503 (not persisted).  Replica B merged while the record was in the file
    but not yet durable — ``read`` takes no lock — and applied it.  The next update (a different
    one) becomes record 1 on A; B, already at version 1, skips it: both replicas say version 1
    but hold different operators, and B counts an update nobody acknowledged.  Readers should
    take the lock shared (``LOCK_SH``) so that they never see a record before its append
    completed."""
    import service.shared as shared_mod

    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))  # another process: its own log object
    try:
        (inc1, q1), (inc2, q2) = _oracle_pairs(2, rows=3, seed=21)
        real = shared_mod.append_durably

        merger = threading.Thread(target=lambda: b.get(NAME).merge())

        def fsync_fails_after_b_merged(fh, data):
            start = fh.seek(0, 2)
            fh.write(data)
            merger.start()  # B's background merge runs while A waits for fsync
            merger.join(timeout=0.5)  # (it must wait for the append to finish)
            fh.truncate(start)  # what append_durably does when fsync raises
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(shared_mod, "append_durably", fsync_fails_after_b_merged)
        with pytest.raises(PersistError):
            _observe(a, inc1, q1)
        merger.join(timeout=30)
        assert not merger.is_alive()
        assert b.get(NAME).version == 0
        monkeypatch.setattr(shared_mod, "append_durably", real)
        _observe(a, inc2, q2)
        b.get(NAME).merge()
        test = probe("logistic", 30, seed=3)
        pa, pb = _predict(a, test), _predict(b, test)
        assert pa[3] == pb[3] == 1
        assert _same_prediction(pa, pb), "two replicas at version 1 hold different operators"
    finally:
        a.abandon()
        b.abandon()


# ------------------------------------------------------------------------------ creation vs adoption
def test_create_races_with_adoption_of_its_own_published_base(store_dir, pristine_store, tmp_path):
    shared = DirectorySharedLog(tmp_path / "shared")
    a = _open(store_dir, shared)
    try:
        jit = load_pristine(pristine_store, NAME)
        real_publish = shared.publish_base

        got = {}

        def request():
            try:
                got["entry"] = a.get("fresh-op")
            except Exception as exc:  # pragma: no cover - reported below
                got["error"] = exc

        def publish_then_concurrent_request(name, blob):
            out = real_publish(name, blob)
            # a request for the new name (or the merge thread) arrives between publish and install
            t = threading.Thread(target=request)
            t.start()
            t.join(timeout=0.5)  # it waits for the creation to finish (or, the bug, adopts first)
            got["thread"] = t
            return out

        shared.publish_base = publish_then_concurrent_request
        entry = a.create("fresh-op", jit, {"threshold": jit.threshold})
        got["thread"].join(timeout=30)
        assert entry.name == "fresh-op"
        assert a.get("fresh-op") is entry
        assert got.get("entry") is entry, got.get("error")
    finally:
        a.abandon()


# ------------------------------------------------------------------------------ restart paths
def test_restarted_replica_catches_up_and_equals_the_other(store_dir, tmp_path):
    """Works: A snapshots at close (version 2, naming its base), B appends 2 more, A restarts
    from its snapshot and catches up: both at 4, bit for bit."""
    shared_dir = tmp_path / "shared"
    pairs = _oracle_pairs(4, rows=2, seed=31)
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        for inc, q in pairs[:2]:
            _observe(a, inc, q)
        a.close()
        for inc, q in pairs[2:]:
            _observe(b, inc, q)
        a = _open(store_dir, DirectorySharedLog(shared_dir))
        test = probe("logistic", 30, seed=4)
        pa, pb = _predict(a, test), _predict(b, test)
        assert pa[3] == pb[3] == 4
        assert _same_prediction(pa, pb)
    finally:
        a.abandon()
        b.abandon()


def test_restart_detects_a_shared_log_rewritten_below_its_version(store_dir, tmp_path, redis_url):
    """A closes at version 2 (snapshot).  Redis loses record 2 (restart without ``appendfsync
    always``, which is only warned about; here an LTRIM), B appends another record 2.  A
    restarts: the log holds 2 records, A's snapshot is at 2, so it catches up nothing and serves
    a version 2 that is not B's version 2 — silently, and forever."""
    pairs = _oracle_pairs(3, rows=2, seed=41)
    a = _open(store_dir, open_shared(redis_url))
    try:
        for inc, q in pairs[:2]:
            _observe(a, inc, q)
    finally:
        a.close()
    r = open_shared(redis_url)
    r.client.ltrim(r._key(NAME, "log"), 0, 0)  # the tail Redis did not persist
    r.close()
    b = _open(tmp_path / "b", open_shared(redis_url))
    a = None
    try:
        _observe(b, *pairs[2])  # a different record 2
        a = _open(store_dir, open_shared(redis_url))
        test = probe("logistic", 30, seed=5)
        if NAME in a.failed:
            return  # refusing to serve is a correct answer
        pa, pb = _predict(a, test), _predict(b, test)
        assert pa[3] == pb[3] == 2
        assert _same_prediction(pa, pb), "both at version 2, different operators"
    finally:
        b.abandon()
        if a is not None:
            a.abandon()


def test_replica_store_that_took_standalone_updates_does_not_pass_them_off_as_shared(store_dir, tmp_path):
    """A replica's store is once served without KJIT_SHARED_STORE (a misconfigured restart) and
    takes an update (local log record 3 after its snapshot at shared version 2), then crashes
    (no final snapshot).  Meanwhile B appends a different record 3.  Back as a replica, A's
    snapshot names the current base, so A keeps the replayed local record as "version 3" and
    catches up nothing.  It should refuse (or rebase onto the shared log), not diverge."""
    shared_dir = tmp_path / "shared"
    pairs = _oracle_pairs(4, rows=2, seed=51)
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    for inc, q in pairs[:2]:
        _observe(a, inc, q)
    a.close()
    solo = _open(store_dir, None)  # the same store, standalone
    _observe(solo, *pairs[2])
    solo.abandon()
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    a = None
    try:
        _observe(b, *pairs[3])
        a = _open(store_dir, DirectorySharedLog(shared_dir))
        if NAME in a.failed:
            return  # refusing is correct
        test = probe("logistic", 30, seed=6)
        pa, pb = _predict(a, test), _predict(b, test)
        assert pa[3] == pb[3] == 3
        assert _same_prediction(pa, pb), "both at version 3, different operators"
    finally:
        b.abandon()
        if a is not None:
            a.abandon()


# ------------------------------------------------------------------------------ unknown outcomes
def _app_client(store, shared):
    from fastapi.testclient import TestClient

    from service import create_app
    from test_service_fixtures import settings_for, wait_ready

    app = create_app(settings_for(store, shared_store=shared, merge_interval=0))
    client = TestClient(app)
    client.__enter__()
    wait_ready(client)
    return app, client


def _lands_then_errors(shared):
    """append() stores the record and then reports a broken connection; the read that follows fails too."""
    real_append, real_read = shared.append, shared.read
    state = {"fail_read": False}

    def append(name, expected, record):
        ok = real_append(name, expected, record)
        state["fail_read"] = True
        raise SharedLogError("connection reset by peer")

    def read(name, after):
        if state["fail_read"]:
            state["fail_read"] = False
            raise SharedLogError("connection reset by peer")
        return real_read(name, after)

    shared.append, shared.read = append, read
    return lambda: setattr(shared, "append", real_append)


def test_unknown_outcome_is_not_reported_as_nothing_added(store_dir, tmp_path):
    from test_service import beliefs_body, body

    app, c = _app_client(store_dir, str(tmp_path / "shared"))
    try:
        restore = _lands_then_errors(app.state.store.shared)
        (inc, q), = _oracle_pairs(1, rows=2, seed=61)
        r = c.post(f"/v1/operators/{NAME}/observations", headers={"Authorization": "Bearer s3cret-token"},
                   json={"incoming": body(inc, "x")["incoming"], "beliefs": beliefs_body(q)})
        restore()
        assert r.status_code == 503
        msg = r.json()["detail"][0]["msg"]
        m = c.post(f"/v1/operators/{NAME}/merge", headers={"Authorization": "Bearer s3cret-token"}).json()
        assert m["version"] == 1 and m["merged"] == 1  # the update was in fact added
        assert "nothing was added" not in msg, msg
    finally:
        c.__exit__(None, None, None)


def test_unknown_outcome_then_retry_on_other_replica_counts_once(store_dir, tmp_path):
    """Works: the append landed but A could not tell (503); the client retries with the same
    Idempotency-Key on B, which sees the record with that key and answers duplicate."""
    shared_dir = tmp_path / "shared"
    sa = DirectorySharedLog(shared_dir)
    a = _open(store_dir, sa)
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        (inc, q), = _oracle_pairs(1, rows=3, seed=71)
        restore = _lands_then_errors(sa)
        with pytest.raises(PersistError, match="may or may not have been recorded"):
            _observe(a, inc, q, key="k-1")
        restore()
        assert _observe(b, inc, q, key="k-1") == (1, 3, True)
        assert _observe(a, inc, q, key="k-1") == (1, 3, True)
        with pytest.raises(Conflict):
            b.get(NAME).observe(inc, q, "k-1", "another-body")
        assert a.get(NAME).version == b.get(NAME).version == 1
        assert int(a.get(NAME).jit.operator.n_train_) == 303
    finally:
        a.abandon()
        b.abandon()


def test_idempotency_keys_survive_a_restart_from_a_snapshot(store_dir, tmp_path):
    """Works: the keys travel in the records and the snapshots; a replica restarted from its
    snapshot (the record with the key is below its snapshot version) still answers duplicate."""
    shared_dir = tmp_path / "shared"
    (inc, q), = _oracle_pairs(1, rows=2, seed=72)
    a = _open(store_dir, DirectorySharedLog(shared_dir), snapshot_every=1)
    _observe(a, inc, q, key="k-snap")
    a.close()
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    try:
        assert a.get(NAME).snapshot_version == 1
        assert _observe(a, inc, q, key="k-snap") == (1, 2, True)
        assert _observe(b, inc, q, key="k-snap") == (1, 2, True)
        # the pairs at the key's version travel too (beside the keys, which a server before the
        # twenty-third session reads: [key, hash, version, rows])
        assert a.get(NAME).observe(inc, q, "k-snap", "h-k-snap")[3] == int(a.get(NAME).jit.operator.n_train_)
    finally:
        a.abandon()
        b.abandon()


# ------------------------------------------------------------------------------ transient shared-store errors
def test_transient_shared_store_error_at_start_is_retried(store_dir, tmp_path):
    import time

    shared = DirectorySharedLog(tmp_path / "shared")
    real_get_base = shared.get_base
    glitch = {"n": 1}

    def get_base(name):
        if name == NAME and glitch["n"]:
            glitch["n"] -= 1
            raise SharedLogError("Timeout reading from socket")
        return real_get_base(name)

    shared.get_base = get_base
    a = _open(store_dir, shared, merge_interval=0.05)
    try:
        assert glitch["n"] == 0 and NAME in a.retry and NAME not in a.failed  # the glitch hit while loading
        t_end = time.monotonic() + 30
        while True:
            try:
                a.get(NAME)
                break
            except NotReady:
                assert time.monotonic() < t_end, f"still failed after the glitch: {a.failed}"
                time.sleep(0.05)
    finally:
        a.abandon()


# ------------------------------------------------------------------------------ the directory log itself
def test_directory_log_offset_cache_across_instances_with_a_torn_tail(tmp_path):
    """Works: a reader (another process: its own instance, cached offsets) sees a torn tail of a
    dead writer, which a third writer cuts before appending; the reader's cache stays right."""
    from service.store import encode_record

    def rec(i):
        return encode_record({"seq": i, "pad": "z" * (3 * i)})

    reader = DirectorySharedLog(tmp_path / "s")
    w1 = DirectorySharedLog(tmp_path / "s")
    w2 = DirectorySharedLog(tmp_path / "s")
    assert w1.append("op", 0, rec(1)) and w1.append("op", 1, rec(2))
    assert reader.length("op") == 2
    with open(tmp_path / "s" / "op" / "log.jsonl", "ab") as fh:
        fh.write(rec(3)[:-9])  # w1 died in the middle of record 3
    assert reader.length("op") == 2 and reader.read("op", 2) == []
    assert not w2.append("op", 3, rec(4)) and w2.append("op", 2, rec(3))
    assert w2.append("op", 3, rec(4))
    assert reader.read("op", 1) == [rec(2), rec(3), rec(4)]
    assert reader.length("op") == 4
    assert w1.read("op", 0) == [rec(i) for i in range(1, 5)]


def test_concurrent_appenders_in_threads_of_one_process(tmp_path):
    """Works: the in-process mutex plus flock serialise appenders sharing one log object and
    appenders with their own objects; no record is lost or duplicated."""
    from service.store import encode_record

    logs = [DirectorySharedLog(tmp_path / "s") for _ in range(2)]
    done = []

    def worker(k, log):
        n = 0
        while n < 25:
            v = log.length("op")
            if log.append("op", v, encode_record({"w": k, "n": n})):
                n += 1
        done.append(k)

    ts = [threading.Thread(target=worker, args=(k, logs[k % 2])) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert len(done) == 4
    recs = DirectorySharedLog(tmp_path / "s").read("op", 0)
    assert len(recs) == 100 and len(set(recs)) == 100


# ------------------------------------------------------------------------------ joining
def test_standalone_store_with_replayed_records_publishes_a_base_others_match_bit_for_bit(store_dir, tmp_path):
    """Works: a standalone store that learned 2 updates (replayed from its local log on start)
    joins an empty shared store: its live state becomes the base at version 0 and a replica
    that adopts the base blob predicts bit for bit like it (the state round-trips exactly)."""
    pairs = _oracle_pairs(3, rows=2, seed=81)
    solo = _open(store_dir, None)
    for inc, q in pairs[:2]:
        _observe(solo, inc, q)
    solo.abandon()  # no snapshot: the join replays the local log
    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        test = probe("logistic", 30, seed=8)
        pa, pb = _predict(a, test), _predict(b, test)
        assert pa[3] == pb[3] == 0
        assert _same_prediction(pa, pb)
        assert int(a.get(NAME).jit.operator.n_train_) == 304
        _observe(b, *pairs[2])
        a.get(NAME).merge()
        pa, pb = _predict(a, test), _predict(b, test)
        assert pa[3] == pb[3] == 1 and _same_prediction(pa, pb)
    finally:
        a.abandon()
        b.abandon()


def test_background_merges_snapshots_and_concurrent_writers_stay_one_prefix(store_dir, pristine_store, tmp_path):
    """Works: two replicas with merge threads every 10 ms and a snapshot every 2 records, two
    writer threads per replica and a reader thread, all at once; afterwards both replicas (and a
    third restarted from its snapshots) equal the pristine operator fed the log in order."""
    import json
    import time

    from service.store import decode_record

    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir), merge_interval=0.01, snapshot_every=2)
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir), merge_interval=0.01, snapshot_every=2)
    pairs = _oracle_pairs(24, rows=2, seed=91)
    errors = []
    stop = threading.Event()

    def write(store, idx):
        try:
            for i in idx:
                _observe(store, *pairs[i], key=f"k{i}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def read(store):
        test = probe("logistic", 10, seed=1)
        last = 0
        try:
            while not stop.is_set():
                v = _predict(store, test)[3]
                assert v >= last, "versions went backwards"
                last = v
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    ts = [threading.Thread(target=write, args=(s, range(k, 24, 4))) for k, s in enumerate((a, b, a, b))]
    rs = [threading.Thread(target=read, args=(s,)) for s in (a, b)]
    for t in ts + rs:
        t.start()
    for t in ts:
        t.join(timeout=120)
    stop.set()
    for t in rs:
        t.join(timeout=30)
    try:
        assert not errors, errors
        t_end = time.monotonic() + 60
        while not (a.get(NAME).version == b.get(NAME).version == 24):
            assert time.monotonic() < t_end
            time.sleep(0.02)
        test = probe("logistic", 30, seed=9)
        pa, pb = _predict(a, test), _predict(b, test)
        assert _same_prediction(pa, pb)
        local = load_pristine(pristine_store, NAME)
        from kjit.families import Gaussian
        from kjit.factors import Logistic
        fams = Logistic().families
        for raw in DirectorySharedLog(shared_dir).read(NAME, 0):
            rec = decode_record(raw.rstrip(b"\n"))
            inc = {v: fams[v].from_dict(d) for v, d in rec["incoming"].items()}
            local.operator.partial_fit(inc, Gaussian.from_dict(rec["beliefs"]))
        q, lv = local.operator.predict(test)
        np.testing.assert_array_equal(pa[0], q.mean())
        np.testing.assert_array_equal(pa[2], local.screen_certified(test)[1].log_var)
        assert json.loads(json.dumps(sorted(a.get(NAME).keys))) == sorted(f"k{i}" for i in range(24))
    finally:
        a.close()
        b.abandon()
    c = _open(store_dir, DirectorySharedLog(shared_dir))
    try:
        pc = _predict(c, test)
        assert pc[3] == 24 and _same_prediction(pa, pc)
    finally:
        c.abandon()


def test_restart_refuses_a_shared_log_shorter_than_its_snapshot(store_dir, tmp_path):
    """Works (on start, unlike a running replica): the shared log lost records this replica's
    snapshot already holds → the operator is reported failed, not served."""
    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    for inc, q in _oracle_pairs(2, rows=2, seed=101):
        _observe(a, inc, q)
    a.close()
    logf = shared_dir / NAME / "log.jsonl"
    logf.write_bytes(logf.read_bytes().split(b"\n")[0] + b"\n")
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    try:
        assert NAME in a.failed and "fewer than 2 records" in a.failed[NAME]
        with pytest.raises(NotReady):
            a.get(NAME)
    finally:
        a.abandon()


def test_a_lost_shared_store_fails_the_replica_instead_of_publishing_it_again(store_dir, tmp_path):
    """Found by an audit: the shared store lost everything (a Redis without its append-only file
    restarted, a re-created volume) and a replica at version 3 restarted: it published its state
    as a new base at version 0, its idempotency keys forgotten — a retried acknowledged key was
    applied a second time.  Now it is reported failed, saying what to do, and publishes nothing;
    served under another name (its directory renamed) its state is published as a new operator."""
    shared_dir = tmp_path / "shared"
    pairs = _oracle_pairs(3, rows=2, seed=141)
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    for i, (inc, q) in enumerate(pairs):
        _observe(a, inc, q, key=f"k{i}")
    a.close()  # (snapshot at version 3, naming its base)
    shutil.rmtree(shared_dir)
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    try:
        assert NAME in a.failed, "served again without the history it acknowledged"
        why = a.failed[NAME]
        assert "holds no base" in why and "3 acknowledged update(s)" in why and "rename" in why, why
        with pytest.raises(NotReady):
            a.get(NAME)
        assert DirectorySharedLog(shared_dir).get_base(NAME) is None  # nothing was published
    finally:
        a.abandon()
    # the way out the message names: the copy under another name is a new operator, its updates kept
    (store_dir / "operators" / NAME).rename(store_dir / "operators" / "logistic-x2")
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        assert a.failed == {} and b.failed == {}
        e = a.get("logistic-x2")
        assert e.version == 0 and int(e.jit.operator.n_train_) == 306 and e.meta["name"] == "logistic-x2"
        test = probe("logistic", 30, seed=14)
        pa, pb = a.get("logistic-x2").predict(test, "predict"), b.get("logistic-x2").predict(test, "predict")
        assert np.array_equal(pa[0].mean(), pb[0].mean()) and np.array_equal(pa[1], pb[1])
    finally:
        a.abandon()
        b.abandon()


def test_a_replaced_shared_store_fails_the_replica_instead_of_adopting_its_base(store_dir, pristine_store, tmp_path):
    """Found by an audit: the shared store was replaced (emptied, then another store published its
    own copy of the operator and took 2 updates) and a replica at version 2 restarted: it adopted
    the other base, dropping its 2 acknowledged updates without a word (the lost-history check came
    after, and the other log is as long).  Now it is reported failed.  The store that published the
    new base recorded none (it was never a replica): that publication is legitimate and unchanged."""
    from test_service_fixtures import copy_store

    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    pairs = _oracle_pairs(3, rows=2, seed=151)
    for inc, q in pairs[:2]:
        _observe(a, inc, q)
    a.close()
    shutil.rmtree(shared_dir)
    copy_store(pristine_store, tmp_path / "b")
    solo = _open(tmp_path / "b", None)  # (another copy: one that learned an update standalone)
    _observe(solo, *pairs[2])
    solo.close()
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))  # publishes its state, at version 0
    a = None
    try:
        assert b.failed == {} and b.get(NAME).version == 0
        _observe(b, *pairs[2])
        _observe(b, *pairs[2])
        a = _open(store_dir, DirectorySharedLog(shared_dir))
        assert NAME in a.failed, "adopted another base, dropping 2 acknowledged updates"
        assert "holds another base" in a.failed[NAME] and "2 acknowledged update(s)" in a.failed[NAME]
    finally:
        b.abandon()
        if a is not None:
            a.abandon()


def test_directory_log_fsyncs_new_directory_entries(tmp_path, monkeypatch):
    """An acknowledged append must survive a power cut: fsync of the file alone does not make a
    newly created file's (or directory's) name durable on POSIX; the local store fsyncs the
    directory after creating a log, the shared directory log does not."""
    import os

    import service.shared as shared_mod
    from service.store import encode_record

    synced = []
    real = shared_mod.fsync_dir
    monkeypatch.setattr(shared_mod, "fsync_dir", lambda p: (synced.append(os.fspath(p)), real(p)))
    root = tmp_path / "s"
    log = DirectorySharedLog(root)
    log.publish_base("op", b"base")
    assert os.fspath(root) in synced, "the new operator directory's name is not durable"
    synced.clear()
    assert log.append("op", 0, encode_record({"seq": 1}))
    assert os.fspath(root / "op") in synced, "the new log.jsonl's name is not durable"


def test_redis_timeout_during_append_then_retry_counts_once(store_dir, tmp_path, redis_url):
    """Works: Redis stalls writes (CLIENT PAUSE … WRITE) so A's compare-and-set times out: A
    answers PersistError ("may or may not have been recorded").  Whether or not the stalled script ran, the retry
    with the same Idempotency-Key on B leaves exactly one record with that key in the log."""
    from service.store import decode_record

    sa = open_shared(redis_url)
    a = _open(store_dir, sa)
    b = _open(tmp_path / "b", open_shared(redis_url))
    admin = open_shared(redis_url)
    try:
        (inc, q), = _oracle_pairs(1, rows=2, seed=111)
        import redis

        from service.shared import _APPEND_LUA

        fast, slow = redis.Redis.from_url(redis_url, socket_timeout=0.3), sa.client
        sa.client, sa._append = fast, fast.register_script(_APPEND_LUA)
        # paused until A has timed out (a fixed 1 s pause could end before a slow machine's A reached Redis)
        admin.client.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
        with pytest.raises(PersistError, match="may or may not have been recorded"):
            _observe(a, inc, q, key="k-timeout")
        admin.client.execute_command("CLIENT", "UNPAUSE")
        sa.client, sa._append = slow, slow.register_script(_APPEND_LUA)
        fast.close()
        version, n, _dup = _observe(b, inc, q, key="k-timeout")
        assert (version, n) == (1, 2)
        a.get(NAME).merge()
        recs = [decode_record(r.rstrip(b"\n")) for r in admin.read(NAME, 0)]
        assert [r.get("key") for r in recs] == ["k-timeout"]
        assert a.get(NAME).version == b.get(NAME).version == 1
    finally:
        admin.client.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        a.abandon()
        b.abandon()


@pytest.mark.parametrize("aside", [False, True])
def test_jit_response_version_and_what_its_predicted_rows_reflect(store_dir, tmp_path, aside):
    """The documented semantics of jit on a replica (service/README.md): the answer is the one
    the operator at the version just before the request's own record gives, and ``version`` is
    the state after that record.  Replica A takes a jit request; between its answer and its
    append, B appends an observation (A's compare-and-set loses): A undoes what it learned,
    merges B's record and answers again, so its answer is that of version 1, its version 2.
    ``aside``: a request of ASIDE_ROWS messages, answered by a copy of the JIT, which A drops."""
    import copy

    from service.store import ASIDE_ROWS
    from test_service_observe_aside import _far

    shared_dir = tmp_path / "shared"
    sa = DirectorySharedLog(shared_dir)
    a = _open(store_dir, sa)
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        real_append = sa.append
        raced = []

        def append(name, expected, record):
            if not raced:
                raced.append(_observe(b, *_oracle_pairs(1, rows=2, seed=121)[0]))
            return real_append(name, expected, record)

        sa.append = append
        test = _far(ASIDE_ROWS, 33) if aside else probe("logistic", 20, seed=122)
        q, logvar, consulted, version, n_learned = a.get(NAME).predict(test, "jit")
        sa.append = real_append
        assert consulted.any() and not consulted.all() and raced
        at_v1 = copy.deepcopy(b.get(NAME).jit)  # B: its own record, not A's
        # the consulted rows learned, but for those below the density guard
        assert version == 2 and n_learned == (consulted & ~at_v1.outside_rows(test)).sum()
        assert b.get(NAME).version == 1
        q1, lv1, c1 = at_v1.predict(test)
        np.testing.assert_array_equal(c1, consulted)
        np.testing.assert_array_equal(q1.mean(), q.mean())
        np.testing.assert_array_equal(lv1, logvar)
        _merged_alike(a, b, test, 2)  # (and after merging, B is A bit for bit)
    finally:
        a.abandon()
        b.abandon()


def test_damaged_final_record_of_the_directory_log_is_treated_as_torn(store_dir, tmp_path):
    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    pairs = _oracle_pairs(2, rows=2, seed=131)
    try:
        _observe(a, *pairs[0])
    finally:
        a.close()
    logf = shared_dir / NAME / "log.jsonl"
    good = logf.read_bytes()
    rec2 = good.split(b"\n")[0] + b"\n"
    logf.write_bytes(good + b"\0" * (len(rec2) - 40) + rec2[-40:])  # record 2: first page lost, tail kept
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    try:
        assert NAME not in a.failed, a.failed.get(NAME)
        assert _observe(a, *pairs[1])[0] == 2
    finally:
        a.abandon()


@pytest.mark.parametrize("kind", ["jit", "observe"])
def test_lost_append_answer_names_its_own_record_when_another_replica_followed(store_dir, tmp_path, kind):
    """A's append lands but its answer is lost (a Redis reply lost to a socket timeout) and B appends
    right after: A's catch-up finds its record and applies B's too.  The answer is A's record's: a jit
    answer said version 2 — B's record included, which it does not reflect (found by an audit) — and an
    observation's ``n_train`` counted B's pairs."""
    shared_dir = tmp_path / "shared"
    sa = DirectorySharedLog(shared_dir)
    a = _open(store_dir, sa)
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        (inc, q), (inc_b, q_b) = _oracle_pairs(2, rows=3, seed=81)
        real_append = sa.append

        def append(name, expected, record):
            assert real_append(name, expected, record)
            sa.append = real_append
            assert _observe(b, inc_b, q_b) == (2, 3, False)  # B's update lands right after A's record
            raise SharedLogError("Timeout reading from socket")

        sa.append = append
        ea = a.get(NAME)
        n0 = int(ea.jit.operator.n_train_)
        if kind == "jit":
            ea.jit.threshold = -1e3  # every row consulted and learned
            _, _, consulted, version, n_learned = ea.predict(inc, "jit")
            assert (version, n_learned) == (1, 3) and np.all(consulted)
        else:
            version, accepted, dup, n_train = ea.observe(inc, q, "k-a", "h-k-a")
            assert (version, accepted, dup, n_train) == (1, 3, False, n0 + 3)
            assert _observe(a, inc, q, key="k-a") == (1, 3, True)
            assert ea.keys.seen("k-a", "h-k-a")[2] == n0 + 3
        assert ea.version == 2 and int(ea.jit.operator.n_train_) == n0 + 6
    finally:
        a.abandon()
        b.abandon()


def test_idempotency_keys_stay_readable_by_an_older_server():
    """The keys' JSON in a snapshot stays [key, hash, version, rows] (a server before the twenty-third
    session unpacks four items and refused a fifth — found in review); the pairs at each key's version
    are kept beside them, and keys without them (an older snapshot) answer None."""
    import json

    from service.store.idempotency import IdempotencyKeys

    keys = IdempotencyKeys()
    keys.remember("k1", "h1", 3, 5, 120)
    keys.remember("k2", "h2", 4, 1)
    text, counts = keys.to_json()
    assert [(k, h, s, n) for k, h, s, n in json.loads(text)] == [("k1", "h1", 3, 5), ("k2", "h2", 4, 1)]
    back = IdempotencyKeys.from_json(text, counts)
    assert back.seen("k1", "h1") == (3, 5, 120) and back.seen("k2", "h2") == (4, 1, None)
    assert IdempotencyKeys.from_json(text).seen("k1", "h1") == (3, 5, None)  # an older snapshot
    # (five items: a snapshot of this session's interim format kept the count inline — found in review)
    assert IdempotencyKeys.from_json('[["k1", "h1", 3, 5, 120]]').seen("k1", "h1") == (3, 5, 120)


# ------------------------------------------------------------------------------ long jit requests aside
def test_a_long_jit_request_on_a_replica_is_answered_aside_bit_identically(store_dir, pristine_store, tmp_path,
                                                                              monkeypatch):
    """A replica's mode=jit batch of ASIDE_ROWS rows consults its oracle on a copy: a prediction issued while the
    oracle runs is answered at once, at the version before (it waited for the whole oracle run: the exclusive lock
    was held throughout), and the result — answers, record, state — is the in-place JIT's; another replica
    applying the shared log gets the same state bit for bit."""
    from kjit.operators import JITOperator
    from service.store import ASIDE_ROWS
    from service.store.blas import one_blas_thread
    from test_service_observe_aside import _far, _held

    inc = _far(ASIDE_ROWS, 31)
    test = probe("logistic", 16, seed=32)
    ref = load_pristine(pristine_store, NAME)
    with one_blas_thread():
        q_ref, cert_ref = ref.certified(inc, "x")
    assert ref.counters()["updates"] > 0
    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        ea = a.get(NAME)
        served, before = ea.jit, _predict(a, test)
        with _held(monkeypatch, JITOperator, "_oracle_beliefs", lambda: ea.predict(inc, "jit")) as out:
            q_mid, _, _, version_mid, _ = ea.predict(test, "predict", wait=False)  # not blocked: the state before
            assert version_mid == 0 and ea.jit is served
            np.testing.assert_array_equal(q_mid.mean(), before[0])
        q, _, consulted, version, n_learned = out["r"]
        assert (version, n_learned) == (1, ref.counters()["updates"]) and ea.jit is not served
        np.testing.assert_array_equal(consulted, cert_ref.source != "learned")
        for x, y in zip(q.params, q_ref.params):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(_predict(a, test)[0], ref.operator.predict(test)[0].mean())
        assert ea.jit.counters()["consultations"] == ref.counters()["consultations"]
        _merged_alike(a, b, test, 1)
    finally:
        a.abandon()
        b.abandon()


def test_a_long_jit_request_on_a_replica_whose_oracle_fails_changes_nothing(store_dir, tmp_path, monkeypatch):
    from kjit.operators import JITOperator
    from kjit.oracles import OracleError
    from service.store import ASIDE_ROWS, OracleFailure
    from test_service_observe_aside import _far

    a = _open(store_dir, DirectorySharedLog(tmp_path / "shared"))
    try:
        e = a.get(NAME)
        served, counters, test = e.jit, e.jit.raw_counters(), probe("logistic", 16, seed=34)
        before = _predict(a, test)

        def boom(self, *args, **kw):
            raise OracleError("the oracle is down")

        monkeypatch.setattr(JITOperator, "_oracle_beliefs", boom)
        with pytest.raises(OracleFailure):
            e.predict(_far(ASIDE_ROWS, 35), "jit")
        assert e.jit is served and e.version == 0 and e.jit.raw_counters() == counters
        assert a.shared.length(NAME) == 0 and _same_prediction(_predict(a, test), before)
    finally:
        a.abandon()


def test_a_long_observation_on_a_replica_is_learned_aside_bit_identically(store_dir, pristine_store, tmp_path,
                                                                           monkeypatch):
    """A replica's observations request of ASIDE_ROWS rows is placed in the shared log, then learned by a copy
    while predictions go on at the version before (they waited for the whole partial_fit: the exclusive lock
    was held), and the copy served: the same state as the pristine operator learning the rows in place, and as
    another replica applying the log; its key is kept."""
    from kjit.operators import KernelOperator
    from service.store import ASIDE_ROWS
    from service.store.blas import one_blas_thread
    from test_service_observe_aside import _held, _pairs

    inc, q = _pairs(ASIDE_ROWS + 20, 36)
    test = probe("logistic", 16, seed=37)
    ref = load_pristine(pristine_store, NAME)
    keep = np.flatnonzero(~ref.outside_rows(inc))
    assert keep.size >= 0.95 * (ASIDE_ROWS + 20)
    with one_blas_thread():
        ref.operator.partial_fit({v: m[keep] for v, m in inc.items()}, q[keep])
    shared_dir = tmp_path / "shared"
    a = _open(store_dir, DirectorySharedLog(shared_dir))
    b = _open(tmp_path / "b", DirectorySharedLog(shared_dir))
    try:
        ea = a.get(NAME)
        served, before = ea.jit, _predict(a, test)
        with _held(monkeypatch, KernelOperator, "partial_fit", lambda: _observe(a, inc, q, key="k-long")) as out:
            q_mid, _, _, version_mid, _ = ea.predict(test, "predict", wait=False)  # not blocked: the state before
            assert version_mid == 0 and ea.jit is served
            np.testing.assert_array_equal(q_mid.mean(), before[0])
        assert out["r"] == (1, keep.size, False) and ea.jit is not served
        np.testing.assert_array_equal(_predict(a, test)[0], ref.operator.predict(test)[0].mean())
        assert _observe(a, inc, q, key="k-long") == (1, keep.size, True)
        _merged_alike(a, b, test, 1)
    finally:
        a.abandon()
        b.abandon()


@pytest.mark.parametrize("aside", [False, True])
def test_a_lost_append_reply_leaves_the_samplers_stream_where_the_request_left_it(store_dir, pristine_store,
                                                                                   tmp_path, aside):
    """A jit request's append lands but its reply is lost: the catch-up applies the record from the log, and the
    served sampler's generator is where answering the request left it — as a local JIT's answering the same batch
    (aside, the copy that answered is dropped: found in review, its generator went with it, and the next request
    drew again the particles whose answers had just been learned)."""
    import copy

    from kjit.factors import Logistic
    from kjit.oracles import ImportanceSamplingOracle
    from service.store import ASIDE_ROWS

    sa = DirectorySharedLog(tmp_path / "shared")
    a = _open(store_dir, sa)
    try:
        ea = a.get(NAME)
        ea.jit.oracle = ImportanceSamplingOracle(Logistic(), n_samples=20000, random_state=0)
        ea.jit.threshold = -1e3  # (every row consulted)
        local, before = copy.deepcopy(ea.jit), ea.jit.oracle_state()
        real_append = sa.append

        def append(name, expected, record):
            assert real_append(name, expected, record)
            sa.append = real_append
            raise SharedLogError("Timeout reading from socket")

        sa.append = append
        inc = probe("logistic", ASIDE_ROWS if aside else 20, seed=31)
        version = ea.predict(inc, "jit")[3]
        local.predict(inc)
        assert version == 1 and ea.jit.oracle_state() == local.oracle_state() != before
    finally:
        a.abandon()
