"""``service.fastpath``: ``POST /v1/operators/{name}/messages?mode=predict`` answered outside FastAPI
gives exactly what the FastAPI route gives — status, content type and body, byte for byte — on
answers and on every kind of error, and it is the path such requests take."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import service.fastpath as fastpath
from service.app import create_app

from test_service_fixtures import TOKEN, copy_store, pristine_store, probe, settings_for, wait_ready  # noqa: F401

PATH = "/v1/operators/{}/messages"


def _body(incoming, to="x"):
    return {"to": to, "incoming": {v: {"family": type(m).__name__.lower(), **m.to_dict()} for v, m in incoming.items()}}


@pytest.fixture(scope="module")
def clients(pristine_store, tmp_path_factory):
    """(with the fast path, without it): two apps on two copies of one store."""
    root = tmp_path_factory.mktemp("fastpath")
    fast = create_app(settings_for(copy_store(pristine_store, root / "a")))
    slow = create_app(settings_for(copy_store(pristine_store, root / "b")))
    slow.user_middleware = [m for m in slow.user_middleware if m.cls is not fastpath.PredictFastPath]
    with TestClient(fast) as a, TestClient(slow) as b:
        wait_ready(a)
        wait_ready(b)
        yield a, b


def _cases():
    good = _body(probe("logistic", 3))
    one = _body(probe("logistic", 1))
    neg = json.loads(json.dumps(good))
    neg["incoming"]["x"]["var"][1] = -1.0
    short = json.loads(json.dumps(good))
    short["incoming"]["z"]["alpha"] = short["incoming"]["z"]["alpha"][:2]
    missing = {"to": "x", "incoming": {"x": good["incoming"]["x"]}}
    wrong_family = json.loads(json.dumps(good))
    wrong_family["incoming"]["z"]["family"] = "gaussian"
    long = _body(probe("logistic", 501))  # max_batch is 500
    j = "application/json"
    return {
        "three rows": ("logistic-x", json.dumps(good), j),
        "one row": ("logistic-x", json.dumps(one), j),
        "the other operator": ("logistic-z", json.dumps({**good, "to": "z"}), j),
        "unknown operator": ("nope", json.dumps(good), j),
        "percent-encoded name": ("logistic%2Dx", json.dumps(good), j),
        "wrong recipient": ("logistic-x", json.dumps({**good, "to": "z"}), j),
        "unknown recipient": ("logistic-x", json.dumps({**good, "to": "w"}), j),
        "negative variance": ("logistic-x", json.dumps(neg), j),
        "length mismatch": ("logistic-x", json.dumps(short), j),
        "missing variable": ("logistic-x", json.dumps(missing), j),
        "wrong family": ("logistic-x", json.dumps(wrong_family), j),
        "batch too long": ("logistic-x", json.dumps(long), j),
        "NaN token": ("logistic-x", json.dumps(good).replace(str(good["incoming"]["x"]["mean"][0]), "NaN", 1), j),
        "malformed JSON": ("logistic-x", json.dumps(good)[:-3], j),
        "empty body": ("logistic-x", "", j),
        "not JSON": ("logistic-x", json.dumps(good), "text/plain"),
        "no content type": ("logistic-x", json.dumps(good), None),
    }


@pytest.fixture
def fast_calls(monkeypatch):
    """The names of the operators whose requests the fast path answered (from now on)."""
    calls = []
    real = fastpath.answer

    async def counted(*args, **kw):
        calls.append(args[0].name)
        return await real(*args, **kw)

    monkeypatch.setattr(fastpath, "answer", counted)
    return calls


@pytest.mark.parametrize("case", list(_cases()))
def test_the_fast_path_answers_as_the_route(clients, fast_calls, case):
    name, content, ctype = _cases()[case]
    headers = {} if ctype is None else {"content-type": ctype}
    fast, slow = (c.post(PATH.format(name), params={"mode": "predict"}, content=content.encode(), headers=headers)
                  for c in clients)
    assert fast.status_code == slow.status_code, (fast.text, slow.text)
    assert fast.headers.get("content-type") == slow.headers.get("content-type")
    if fast.status_code == 200:
        assert fast.content == slow.content
        assert fast_calls == [name.replace("%2D", "-")]  # answered by the fast path (the slow app's never reach it)
    else:
        # identical, except an internal error's id
        assert fast.json() == slow.json()
    assert fast.status_code in (200, 400, 404, 422), fast.text


def test_other_requests_go_to_fastapi(clients, fast_calls):
    """Another mode, an extra query parameter, another method: the route, as before."""
    fast, _ = clients
    good = _body(probe("logistic", 2))
    r = fast.post(PATH.format("logistic-x"), params={"mode": "predict", "extra": "1"}, json=good)
    assert r.status_code == 200 and r.json()["mode"] == "predict"
    r = fast.post(PATH.format("logistic-x"), params={"mode": "jit"}, json=good)  # no token: 401, by the middleware
    assert r.status_code == 401
    r = fast.post(PATH.format("logistic-x"), params={"mode": "bogus"}, json=good)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "mode"]
    r = fast.get(PATH.format("logistic-x"), params={"mode": "predict"})
    assert r.status_code == 405
    assert fast_calls == []


def test_fast_path_requests_are_counted_under_the_route(clients):
    fast, _ = clients
    good = _body(probe("logistic", 1))
    fast.post(PATH.format("logistic-x"), params={"mode": "predict"}, json=good)
    text = fast.get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("kjit_http_requests_total{")
                and 'route="/v1/operators/{name}/messages"' in ln and 'status="200"' in ln)
    assert float(line.rsplit(" ", 1)[1]) >= 1


@pytest.fixture
def telemetry_layer(monkeypatch, clients):
    """Requests that passed FastAPI's outer layers (its telemetry middleware), from now on; the
    apps' stacks are rebuilt so that they see the spy."""
    from fastapi.telemetry import _asgi

    seen = []
    real = _asgi.ExceptionTelemetryMiddleware.__call__

    async def spy(self, scope, receive, send):
        seen.append(scope["path"])
        return await real(self, scope, receive, send)

    monkeypatch.setattr(_asgi.ExceptionTelemetryMiddleware, "__call__", spy)
    return seen


def test_the_hot_path_skips_fastapis_outer_layers_and_keeps_the_apps_middleware(clients, telemetry_layer,
                                                                                 fast_calls):
    fast, slow = clients
    good = _body(probe("logistic", 1))
    assert fast.post(PATH.format("logistic-x"), params={"mode": "predict"}, json=good).status_code == 200
    assert fast_calls == ["logistic-x"] and telemetry_layer == []
    assert fast.get("/health").status_code == 200  # anything else: the whole stack
    assert slow.post(PATH.format("logistic-x"), params={"mode": "predict"}, json=good).status_code == 200
    assert telemetry_layer == ["/health", PATH.format("logistic-x")]
    # the app's own middleware still applies on the hot path: the body limit (413) ...
    huge = json.dumps(_body(probe("logistic", 3))) + " " * 2_000_000
    r = fast.post(PATH.format("logistic-x"), params={"mode": "predict"}, content=huge.encode(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["detail"][0]["type"] == "body_too_large"
    assert telemetry_layer == ["/health", PATH.format("logistic-x")]


def test_with_telemetry_on_the_hot_path_takes_the_whole_stack(clients, telemetry_layer, fast_calls, monkeypatch):
    fast, _ = clients
    monkeypatch.setattr(fastpath, "_telemetry", lambda app: True)  # an OpenTelemetry provider configured
    good = _body(probe("logistic", 1))
    assert fast.post(PATH.format("logistic-x"), params={"mode": "predict"}, json=good).status_code == 200
    assert telemetry_layer == [PATH.format("logistic-x")]
    assert fast_calls == ["logistic-x"]  # (the fast path inside the whole stack still answers)


def test_an_unexpected_error_on_the_hot_path_is_the_apps_500(clients, monkeypatch):
    import service.routers.messages as messages_route

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(messages_route, "_messages", boom)
    good = _body(probe("logistic", 1))
    fast, slow = (TestClient(c.app, raise_server_exceptions=False) for c in clients)
    a, b = (c.post(PATH.format("logistic-x"), params={"mode": "predict"}, json=good) for c in (fast, slow))
    assert a.status_code == b.status_code == 500
    assert a.headers["content-type"] == b.headers["content-type"]
    strip = lambda r: [{k: v for k, v in d.items() if k != "msg"} for d in r.json()["detail"]]  # noqa: E731
    assert strip(a) == strip(b) and "internal error" in a.json()["detail"][0]["msg"]


def test_app_state_reads_as_starlettes_state_without_its_getattr(clients, monkeypatch):
    """app.state (an AppState) behaves as Starlette's State — attribute and item access, iteration,
    deletion, AttributeError for a missing name — and a read of a set value never reaches State's
    __getattr__ (which Python calls only after raising an AttributeError)."""
    from starlette.datastructures import State

    app = clients[0].app
    assert isinstance(app.state, fastpath.AppState)
    for key in ("settings", "store", "metrics", "oracle_slot", "jobs"):  # (jobs: set by the lifespan)
        assert key in app.state.__dict__
    state = fastpath.AppState()
    state.a = 1
    state["b"] = 2
    assert (state.a, state["a"], state.b, state["b"]) == (1, 1, 2, 2) and sorted(state) == ["a", "b"] and len(state) == 2
    state.a = 3
    assert (state.a, state["a"]) == (3, 3)
    del state.a
    del state["b"]
    assert len(state) == 0
    with pytest.raises(AttributeError):
        state.a
    with pytest.raises(AttributeError):
        state.b
    state.c = 4
    calls = []
    real = State.__getattr__
    monkeypatch.setattr(State, "__getattr__", lambda self, key: calls.append(key) or real(self, key))
    assert state.c == 4 and calls == []
    assert getattr(state, "missing", None) is None and calls == ["missing"]


def test_family_name_follows_the_registry():
    """family_name's memo answers what a scan of FAMILIES answers, also after a class is registered
    under another name."""
    from kjit.families import FAMILIES, Gaussian, family_name, register_family

    class Mine(Gaussian):
        pass

    try:
        register_family("mine-a", Mine)
        assert family_name(Mine) == family_name(Mine(0.0, 1.0)) == "mine-a"
        del FAMILIES["mine-a"]
        register_family("mine-b", Mine)
        assert family_name(Mine) == "mine-b"
        del FAMILIES["mine-b"]
        with pytest.raises(ValueError, match="not registered"):
            family_name(Mine)

        class Other(Gaussian):
            pass

        # a class under two names: the first registered, as the scan of FAMILIES answers
        register_family("mine-a", Other)
        register_family("mine-b", Mine)
        assert family_name(Mine) == "mine-b"
        register_family("mine-a", Mine, replace=True)
        assert family_name(Mine) == "mine-a"
    finally:
        FAMILIES.pop("mine-a", None)
        FAMILIES.pop("mine-b", None)
    assert family_name(Gaussian) == "gaussian"


def test_app_state_takes_any_key_and_an_initial_dict():
    """As Starlette's State: a non-string key is an item (no attribute), an initial dict is read as
    attributes, and deleting what the dict held works."""
    state = fastpath.AppState({"a": 1})
    assert state.a == 1
    state[7] = "x"
    state[("t", 1)] = "y"
    assert state[7] == "x" and state[("t", 1)] == "y" and len(state) == 3
    del state[7]
    del state.a
    assert list(state) == [("t", 1)]
    with pytest.raises(AttributeError):
        state.a
