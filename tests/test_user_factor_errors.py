"""A user's own factor, when its code misbehaves (found by an audit of the "user's own factor" path):
its sampler's exceptions are named as the factor's — MemoryError and ArithmeticError / ValueError
included — and answered 422 by the service, naming the factor and the rows, with nothing changed and
the connection still usable; a training job says why its oracle failed on the messages it dropped."""

from __future__ import annotations

import numpy as np
import pytest

import kjit.factors.base as F
from kjit.families import Gaussian
from kjit.oracles import ImportanceSamplingOracle, MessageImportanceSampler

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")


def _raising(exc_type, name):
    def sampler(v, rng):
        if np.any(np.abs(v["x"]) > 4):
            raise exc_type("user sampler: x out of its domain")
        return np.sin(v["x"])
    return F.SampledFactor(name, inputs={"x": Gaussian}, output=("z", Gaussian), sampler=sampler)


@pytest.mark.parametrize("exc_type", [MemoryError, FloatingPointError, ZeroDivisionError, ValueError])
def test_whatever_a_user_sampler_raises_is_named_with_the_rows_whose_draws_raise_it(exc_type):
    """A FloatingPointError / ValueError reached the caller as the sampler's bare words, a MemoryError
    as itself (HTTP 500 in the service); each is now a FactorCodeError (a ValueError) naming the factor
    and its sampler, caused by the user's exception; the per-message sampler names exactly the rows
    whose draws raise it (row 1, at x ~ N(6, 0.05), of four)."""
    f = _raising(exc_type, f"raises_{exc_type.__name__}")
    inc = {"x": Gaussian([0.0, 6.0, -1.0, 0.5], [0.05] * 4), "z": Gaussian([0.0] * 4, [0.5] * 4)}
    with pytest.raises(F.FactorCodeError) as e:
        MessageImportanceSampler(f, random_state=0).belief(inc, "x")
    msg = str(e.value)
    assert f"factor {f.name!r}: its sampler raised {exc_type.__name__}: user sampler: x out of its domain" in msg
    assert "rows [1]" in msg and e.value.rows.tolist() == [1]
    assert isinstance(e.value.__cause__, exc_type)
    # the shared-proposal sampler's particles are every row's: named, without rows
    with pytest.raises(F.FactorCodeError, match=f"factor {f.name!r}: its sampler raised {exc_type.__name__}"):
        ImportanceSamplingOracle(f, n_samples=2000, random_state=0).belief(inc, "x")


def test_an_oracle_error_from_a_user_sampler_passes_as_it_is():
    """An OracleError is the oracles' own signal (rows to skip): it is not renamed."""
    from kjit.errors import OracleError

    def sampler(v, rng):
        raise OracleError("not here", rows=[0])

    f = F.SampledFactor("signals", inputs={"x": Gaussian}, output=("z", Gaussian), sampler=sampler)
    with pytest.raises(OracleError, match="^not here$"):
        MessageImportanceSampler(f, random_state=0).belief({"x": Gaussian([0.0], [1.0]), "z": Gaussian([0.0], [1.0])},
                                                            "x")


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A threaded server with operators (threshold given: no held-out run) for user factors whose samplers
    raise MemoryError / FloatingPointError for |x| > 4, trained on messages where they do not."""
    import httpx

    from service.settings import Settings
    from service.testing import ThreadedServer
    from test_service_fixtures import wait_job

    nan = F.SampledFactor("uf_nan", inputs={"x": Gaussian}, output=("z", Gaussian),
                          sampler=lambda v, rng: np.where(v["x"] > 0.9, np.nan, v["x"]))
    for f in [_raising(t, f"uf_{t.__name__.lower()}") for t in (MemoryError, FloatingPointError)] + [nan]:
        monkeypatch.setitem(F._REGISTRY, f.name, None)  # (removed again after the test)
        F.register_factor(f, replace=True)
    srv = ThreadedServer(Settings(store=tmp_path / "store", default_operators=())).start()
    c = httpx.Client(base_url=srv.url, timeout=120)
    R = {"x": {"mean": {"low": -1, "high": 1}, "var": {"low": 0.01, "high": 0.1, "scale": "log"}},
         "z": {"mean": {"low": -1, "high": 1}, "var": {"low": 0.1, "high": 1, "scale": "log"}}}
    try:
        for name in ("uf_memoryerror", "uf_floatingpointerror"):
            r = c.post("/v1/operators", json={"name": name, "factor": name, "to": "x", "n_inner": 20, "n_outer": 40,
                                              "threshold": -3.0,
                                              "source": {"kind": "oracle", "n": 40, "distribution": R}})
            assert r.status_code == 202, r.text
            assert wait_job(c, r.headers["location"])["status"] == "succeeded"
        c.jobs = {}
        for name, threshold in (("uf_nan", -3.0), ("uf_low", -30.0)):  # (-30: below any floor here)
            r = c.post("/v1/operators", json={"name": name, "factor": "uf_nan", "to": "x", "n_inner": 20, "n_outer": 40,
                                              "threshold": threshold,
                                              "source": {"kind": "oracle", "n": 40, "distribution": R}})
            assert r.status_code == 202, r.text
            c.jobs[name] = wait_job(c, r.headers["location"])
        yield c
    finally:
        c.close()
        srv.stop()


@pytest.mark.parametrize("name, exc_name", [("uf_memoryerror", "MemoryError"),
                                            ("uf_floatingpointerror", "FloatingPointError")])
def test_a_served_user_sampler_that_raises_is_a_422_naming_the_factor_and_rows_and_changes_nothing(served, name,
                                                                                                   exc_name):
    """Found by an audit (exp10_memerr.py): MemoryError from the user's sampler was HTTP 500 in mode=oracle
    and mode=jit; a FloatingPointError a 422 with only the user's bare message.  Now 422 for both, at the
    row whose draws raise it, naming the factor, its sampler and the exception; the operator's version and
    counters are unchanged, and the same connection answers the next request."""
    c = served
    before = c.get(f"/v1/operators/{name}").json()
    g = lambda m: {"family": "gaussian", "mean": m, "var": [0.05] * len(m)}  # noqa: E731
    body = {"to": "x", "incoming": {"x": g([0.0, 6.0]), "z": g([0.0, 0.0])}}
    for mode in ("oracle", "jit"):
        r = c.post(f"/v1/operators/{name}/messages", params={"mode": mode}, json=body)
        assert r.status_code == 422, (mode, r.status_code, r.text)
        items = r.json()["detail"]
        assert [it["loc"][:3] for it in items] == [["body", "incoming", 1]], items
        assert f"factor {name!r}: its sampler raised {exc_name}" in items[0]["msg"], items[0]["msg"]
        # the same connection, at once: answered
        ok = c.post(f"/v1/operators/{name}/messages", params={"mode": "predict"},
                    json={"to": "x", "incoming": {"x": g([0.0]), "z": g([0.0])}})
        assert ok.status_code == 200, ok.text
    after = c.get(f"/v1/operators/{name}").json()
    assert after["version"] == before["version"] and after["n_train"] == before["n_train"]
    assert after["counters"] == before["counters"]


def test_a_training_job_says_why_its_oracle_failed_on_the_pairs_it_dropped(served):
    """Found by an audit: a job whose user sampler returned NaN "succeeded" with n_train 5 of 50 and
    n_failed 45, and nothing said why.  Its result now carries `failures`: per cause the count, the
    first message and its error."""
    job = served.jobs["uf_nan"]
    assert job["status"] == "succeeded", job
    res = job["result"]
    assert res["n_failed"] > 0
    rec = res["failures"]["sampler returned NaN"]
    assert rec["count"] == res["n_failed"] and "factor 'uf_nan': its sampler returned" in rec["first_error"]


def test_a_threshold_below_the_noise_floor_is_said_where_the_user_looks(served):
    """Found by an audit: with calibration failing, the generic fallback −8.5 lay 5–9 nats below the
    operators' noise floors, so mode=jit consulted every row — and neither the job's result nor the
    operator's detail said so (threshold_note null).  Both now say it, with what to do."""
    c = served
    res = c.jobs["uf_low"]["result"]
    assert res["threshold"] == -30.0 and res["threshold_floor"] > -30.0
    for note in (res["threshold_note"], c.get("/v1/operators/uf_low").json()["threshold_note"]):
        assert "below this operator's noise floor" in note and "every message will be consulted" in note
        assert "more pairs" in note and "n_inner" in note
    d = c.get("/v1/operators/uf_low").json()
    assert d["threshold_floor"] == pytest.approx(res["threshold_floor"])
    # and it is true: every message is consulted
    g = lambda m: {"family": "gaussian", "mean": m, "var": [0.05] * len(m)}  # noqa: E731
    r = c.post("/v1/operators/uf_low/messages", params={"mode": "jit"},
               json={"to": "x", "incoming": {"x": g([-0.5, -0.8, -1.0]), "z": g([-0.5, -0.7, -1.0])}})
    assert r.status_code == 200 and r.json()["n_consulted"] == 3, r.text
    # an operator whose threshold is above its floor has no such note
    ok = c.get("/v1/operators/uf_nan").json()
    if ok["threshold"] >= ok["threshold_floor"]:
        assert ok["threshold_note"] is None and "threshold_note" not in c.jobs["uf_nan"]["result"]


def test_a_failed_calibration_falls_back_below_the_floor_and_says_so(monkeypatch):
    """The path the audit met: pairs too few for calibration to meet its KL target, a user factor
    without a default threshold: the generic fallback (−8.5) is kept — not raised to the floor, which
    would serve answers calibration found inaccurate as confident — and the result says the threshold
    is below the floor and every message will be consulted."""
    from kjit.training import make_training_set
    from service.training import FALLBACK_THRESHOLD, TrainSpec, train_operator

    f = F.SampledFactor("uf_tanh", inputs={"x": Gaussian, "y": Gaussian}, output=("z", Gaussian),
                        sampler=lambda v, rng: np.tanh(v["x"]) + v["y"])
    monkeypatch.setitem(F._REGISTRY, f.name, None)
    F.register_factor(f, replace=True)
    rng = np.random.default_rng(0)
    n = 60
    g = lambda lo, hi: Gaussian(rng.uniform(lo, hi, n), np.exp(rng.uniform(np.log(0.01), np.log(2), n)))  # noqa: E731
    inc = {"x": g(-2, 2), "y": g(-2, 2), "z": g(-2, 2)}
    ts = make_training_set(f, "x", inc, MessageImportanceSampler(f, target_se=0.05, random_state=0), random_state=0)
    jit, _, info = train_operator(TrainSpec(factor=f.name, to="x", n_inner=10, n_outer=20, pairs=ts, oracle="client"))
    assert info["threshold"] == FALLBACK_THRESHOLD and "generic fallback" in info["threshold_source"]
    assert info["threshold_floor"] > FALLBACK_THRESHOLD
    assert "every message will be consulted" in info["threshold_note"] and "generic fallback" in info["threshold_note"]
    assert jit.threshold_note() is not None


def test_a_client_without_the_users_factor_module_is_told_to_import_it(served, monkeypatch):
    """Found by an audit: RemoteOperator.belief in a process that had not imported the factor's module
    raised "unknown factor 'audit_exp'; registered: …" with no hint.  It now says the client must
    import/register the module (the one KJIT_FACTORS names), and still lists what is registered."""
    from kjit.client import RemoteOperator

    url = str(served.base_url).rstrip("/")
    monkeypatch.delitem(F._REGISTRY, "uf_nan")  # (this "client process" never imported the module)
    op = RemoteOperator(url, "uf_nan")
    with pytest.raises(F.UnknownFactorError) as e:
        op.belief({"x": Gaussian(-0.5, 0.05), "z": Gaussian(-0.5, 0.05)}, "x")
    msg = str(e.value)
    assert "factor 'uf_nan'" in msg and "not registered in this client process" in msg
    assert "import the module that registers it" in msg and "KJIT_FACTORS" in msg and "registered:" in msg
