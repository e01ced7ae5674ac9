"""Schemathesis fuzzing of the HTTP API (issue 21): no body generated from the OpenAPI schema —
valid, or negative (violating it) — gets a 5xx, and no rejected request changes an operator.
Slow (hundreds of requests); CI runs it with the slow tests."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from service import Settings, create_app  # noqa: E402
from service.testing import ThreadedServer  # noqa: E402

from test_service_fixtures import copy_store, pristine_store, settings_for, TOKEN  # noqa: E402,F401

AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

# the schema does not depend on the store: build it from an app that is never started
schema = schemathesis.openapi.from_dict(create_app(Settings(store="/nonexistent")).openapi())


@pytest.fixture(scope="module")
def live(pristine_store, tmp_path_factory):
    dst = tmp_path_factory.mktemp("fuzz") / "store"
    copy_store(pristine_store, dst)
    # jobs are accepted (202) and trained in the background: keep them tiny
    with ThreadedServer(settings_for(dst, max_train_n=200, max_n_inner=20, max_n_outer=40, max_queued_jobs=2)) as srv:
        yield srv


def _fingerprint(url):
    ops = httpx.get(url + "/v1/operators", timeout=30).json()["operators"]
    return {o["name"]: (o["version"], o["n_train"]) for o in ops}


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_rejections_change_nothing(case, live):
    before = _fingerprint(live.url)
    headers = {**(case.headers or {}), **AUTH}
    r = case.call(base_url=live.url, headers=headers, timeout=60)
    assert r.status_code < 500, (case.method, case.path, r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert _fingerprint(live.url) == before
        body = r.json()
        assert isinstance(body["detail"], list) and len(body["detail"]) <= 20
