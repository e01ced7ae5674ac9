"""Long updates learned aside (issue 17, part 2): an observations request of at least
``ASIDE_ROWS`` rows is learned on a copy while predictions go on with the current operator, and
swapped in once its record is on disk — the same state bit for bit as learning in place, the
same durability (a restart replays it to the same state), and a prediction issued meanwhile is
answered at once, at the version before."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from kjit.factors import Logistic
from kjit.operators import KernelOperator
from kjit.oracles import QuadratureOracle
from kjit.training import DEFAULT_DISTRIBUTIONS
from service.locks import RWLock, WouldBlock
from service.store import ASIDE_ROWS, OperatorStore
from service.store.blas import one_blas_thread

from test_service_fixtures import copy_store, load_pristine, pristine_store  # noqa: F401 - fixture


def _open(root):
    s = OperatorStore(root, snapshot_every=1000)
    s.open()
    s.load_all()
    assert "logistic-x" in s.entries, s.failed
    return s


@pytest.fixture
def root(pristine_store, tmp_path):
    dst = tmp_path / "store"
    copy_store(pristine_store, dst)
    return dst


def _pairs(n, seed):
    inc = DEFAULT_DISTRIBUTIONS["logistic"](n, np.random.default_rng(seed))
    return inc, QuadratureOracle(Logistic()).belief(inc, "x")


@contextlib.contextmanager
def _held(monkeypatch, owner, name, request):
    """Run ``request()`` in a thread with ``owner.name`` held at its first call; yield (a dict whose "r" will be the
    request's result) once it is held; on leaving, release it, join the thread and restore the method."""
    inside, go = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def slow(self, *a, **k):
        inside.set()
        assert go.wait(30)
        return real(self, *a, **k)

    monkeypatch.setattr(owner, name, slow)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=request()))
    t.start()
    try:
        assert inside.wait(30)
        yield out
    finally:
        go.set()
        t.join(60)
        monkeypatch.setattr(owner, name, real)


def _blr(op):
    return op.blr_.state_dict()


def _assert_same(a, b):
    for k in ("A", "b", "yy", "Sigma", "coef", "pending_X", "pending_Y"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert a["n"] == b["n"]


def test_rwlock_update_admits_readers_and_excludes_writers():
    lock = RWLock()
    wrote = threading.Event()

    def writer():
        with lock.write():
            wrote.set()

    with lock.update():
        with lock.read(blocking=False):  # readers go on during the update
            pass
        t = threading.Thread(target=writer)
        t.start()
        assert not wrote.wait(0.2)  # a writer waits for the update...
        with lock.read(blocking=False):  # ...without holding up readers
            pass
        with lock.upgrade():
            with pytest.raises(WouldBlock):
                with lock.read(blocking=False):
                    pass
    t.join(5)
    assert wrote.is_set()


def test_a_long_observation_is_learned_aside_bit_identically_and_durably(root, pristine_store, monkeypatch):
    inc, q = _pairs(ASIDE_ROWS + 44, 3)
    small_inc, small_q = _pairs(5, 4)
    probe = DEFAULT_DISTRIBUTIONS["logistic"](16, np.random.default_rng(5))
    # the reference: the pristine operator learning the same rows in place (as the store learns: one BLAS thread)
    # (but for the pairs outside the data it learned: acknowledged, not learned — JITOperator.outside_rows)
    ref_jit = load_pristine(pristine_store, "logistic-x")
    ref, learned = ref_jit.operator, []
    with one_blas_thread():
        for a, b in ((small_inc, small_q), (inc, q)):
            keep = np.flatnonzero(~ref_jit.outside_rows(a))
            ref.partial_fit({v: m[keep] for v, m in a.items()}, b[keep])
            learned.append(keep.size)
    assert learned[1] >= 0.95 * (ASIDE_ROWS + 44)

    s = _open(root)
    e = s.entries["logistic-x"]
    assert e.observe(small_inc, small_q, None, None)[:3] == (1, learned[0], False)  # in place
    served_before = e.jit
    q_before, _ = e.jit.operator.predict(probe)

    # hold the copy's partial_fit until a prediction has been answered meanwhile
    with _held(monkeypatch, KernelOperator, "partial_fit", lambda: e.observe(inc, q, "k1", "h1")) as out:
        q_mid, _, _, version_mid, _ = e.predict(probe, "predict", wait=False)  # not blocked, the state before
        assert version_mid == 1
        np.testing.assert_array_equal(q_mid.mean(), q_before.mean())
        assert e.jit is served_before
    assert out["r"][:3] == (2, learned[1], False)
    assert out["r"][3] == int(e.jit.operator.n_train_)  # the pairs at version 2 (the aside copy's)
    assert e.jit is not served_before
    _assert_same(_blr(e.jit.operator), _blr(ref))
    assert e.observe(inc, q, "k1", "h1")[:3] == (2, learned[1], True)  # the key is kept
    s.abandon()  # a crash: no final snapshot

    s = _open(root)
    _assert_same(_blr(s.entries["logistic-x"].jit.operator), _blr(ref))
    assert s.entries["logistic-x"].version == 2
    s.abandon()


def test_a_long_observation_that_cannot_be_learned_changes_nothing(root, monkeypatch):
    inc, q = _pairs(ASIDE_ROWS, 6)
    s = _open(root)
    e = s.entries["logistic-x"]
    served, version = e.jit, e.version
    before = _blr(e.jit.operator)

    def boom(self, *a, **k):
        raise FloatingPointError("not computable")

    monkeypatch.setattr(KernelOperator, "partial_fit", boom)
    from service.store import Unprocessable

    with pytest.raises(Unprocessable):
        e.observe(inc, q, None, None)
    assert e.jit is served and e.version == version
    _assert_same(_blr(e.jit.operator), before)
    s.abandon()


def _far(n, seed):
    """Default logistic messages, a fifth of them moved beyond the training means (consulted by the JIT)."""
    inc = DEFAULT_DISTRIBUTIONS["logistic"](n, np.random.default_rng(seed))
    x = inc["x"]
    shift = np.where(np.arange(n) % 5 == 0, 6.0, 0.0)
    return {**inc, "x": type(x)(x.mean() + shift, x.var())}


def test_a_long_jit_request_is_answered_aside_bit_identically_and_durably(root, pristine_store, monkeypatch):
    """A mode=jit batch of ASIDE_ROWS rows consults its oracle on a copy: a prediction issued while the oracle
    runs is answered at once with the operator before, and the result — answers, record, state — is the in-place
    JIT's (the pristine one answering the same batch), replayed to the same state after a crash."""
    from kjit.operators import JITOperator

    inc = _far(ASIDE_ROWS, 11)
    probe = DEFAULT_DISTRIBUTIONS["logistic"](16, np.random.default_rng(5))
    ref = load_pristine(pristine_store, "logistic-x")
    with one_blas_thread():
        q_ref, cert_ref = ref.certified(inc, "x")
    consulted_ref = cert_ref.source != "learned"
    assert 0 < ref.counters()["updates"] <= consulted_ref.sum()

    s = _open(root)
    e = s.entries["logistic-x"]
    served_before, version_before = e.jit, e.version
    q_before, _ = e.jit.operator.predict(probe)
    with _held(monkeypatch, JITOperator, "_oracle_beliefs", lambda: e.predict(inc, "jit")) as out:
        q_mid, _, _, version_mid, _ = e.predict(probe, "predict", wait=False)  # not blocked: the state before
        assert version_mid == version_before and e.jit is served_before
        np.testing.assert_array_equal(q_mid.mean(), q_before.mean())
    q, _, consulted, version, n_learned = out["r"]
    assert version == version_before + 1 and n_learned == ref.counters()["updates"]
    np.testing.assert_array_equal(consulted, consulted_ref)
    for a, b in zip(q.params, q_ref.params):
        np.testing.assert_array_equal(a, b)
    assert e.jit is not served_before
    _assert_same(_blr(e.jit.operator), _blr(ref.operator))
    assert e.jit.counters()["consultations"] == ref.counters()["consultations"]
    s.abandon()  # a crash: no final snapshot

    s = _open(root)
    assert s.entries["logistic-x"].version == version
    _assert_same(_blr(s.entries["logistic-x"].jit.operator), _blr(ref.operator))
    s.abandon()


def test_a_long_jit_request_whose_oracle_fails_changes_nothing(root, monkeypatch):
    from kjit.operators import JITOperator
    from kjit.oracles import OracleError
    from service.store import OracleFailure

    inc = _far(ASIDE_ROWS, 12)
    s = _open(root)
    e = s.entries["logistic-x"]
    served, version, counters = e.jit, e.version, e.jit.raw_counters()
    before = _blr(e.jit.operator)

    def boom(self, *a, **k):
        raise OracleError("the oracle is down")

    monkeypatch.setattr(JITOperator, "_oracle_beliefs", boom)
    with pytest.raises(OracleFailure):
        e.predict(inc, "jit")
    assert e.jit is served and e.version == version and e.jit.raw_counters() == counters
    _assert_same(_blr(e.jit.operator), before)
    s.abandon()


def test_a_sampling_oracle_answers_aside_and_its_stream_goes_on(tmp_path, monkeypatch):
    """mode=oracle with a sampling oracle (its generator is the operator's state) runs on a copy of the sampler
    while predictions go on, and the copy, its generator advanced, replaces it: two requests answer bit for bit
    as one local sampler answering both in turn; a request whose sampler fails leaves the generator where it was."""
    import copy

    from kjit.oracles import ImportanceSamplingOracle, OracleError
    from service.store import OracleFailure
    from test_service_fixtures import probe, small_store

    store = small_store(tmp_path / "store", "is-x", "logistic", "x", oracle="importance_sampling", n_samples=20000)
    e = store.get("is-x")
    local = copy.deepcopy(e.jit.oracle)
    a, b, c = (probe("logistic", 8, seed=s) for s in (61, 62, 63))
    q_probe, version = e.jit.operator.predict(a)[0], e.version

    with _held(monkeypatch, ImportanceSamplingOracle, "certified", lambda: e.predict(a, "oracle")) as out:
        q_mid, _, _, version_mid, _ = e.predict(a, "predict", wait=False)  # not blocked by the sampler's run
        assert version_mid == version
        np.testing.assert_array_equal(q_mid.mean(), q_probe.mean())
    q2 = e.predict(b, "oracle")[0]
    for got, batch in ((out["r"][0], a), (q2, b)):
        np.testing.assert_array_equal(got.mean(), local.belief(batch, "x").mean())

    def boom(self, *args, **kw):
        self._rng.standard_normal(100)  # (draws, then fails: the served generator must not have moved)
        raise OracleError("the sampler failed")

    with monkeypatch.context() as m:
        m.setattr(ImportanceSamplingOracle, "certified", boom)
        with pytest.raises(OracleFailure):
            e.predict(c, "oracle")
    np.testing.assert_array_equal(e.predict(c, "oracle")[0].mean(), local.belief(c, "x").mean())
    store.close()


def test_a_prediction_adds_no_attribute_a_concurrent_copy_could_see_change(root):
    """Long updates and jit requests deep-copy the served JIT while predictions go on: a prediction must not add a
    key to any object's __dict__ (a lazily created cache, KernelOperator._input_bounds, made such a copy fail with
    "dictionary changed size during iteration" — review, forty-third session, 8 of 60 racing trials)."""
    def keys(o, path="jit", seen=None, out=None):
        seen, out = (set() if seen is None else seen), ({} if out is None else out)
        if id(o) in seen or not hasattr(o, "__dict__") or isinstance(o, type):
            return out
        seen.add(id(o))
        out[path] = set(vars(o))
        for k, v in vars(o).items():
            keys(v, f"{path}.{k}", seen, out)
        return out

    s = _open(root)
    e = s.entries["logistic-x"]
    before = keys(e.jit)
    probe = DEFAULT_DISTRIBUTIONS["logistic"](16, np.random.default_rng(5))
    e.predict(probe, "predict")
    e.predict_certified(probe, "predict")
    after = keys(e.jit)
    assert {p: after[p] - before.get(p, set()) for p in after if after[p] - before.get(p, set())} == {}
    s.abandon()
