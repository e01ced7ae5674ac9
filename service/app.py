"""The application factory: ``create_app(settings)``.

Run it with uvicorn (``kjit serve``, ``python -m service``, or
``uvicorn --factory service.app:create_app`` which reads the ``KJIT_*`` environment).
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kjit import __version__ as kjit_version

from . import errors, schemas
from .audit import AuditCollector, Auditor
from .deps import oracle_slot
from .fastpath import HotPathApp, PredictFastPath
from .jobs import JobManager
from .metrics import Metrics
from .middleware import AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware
from .routers import router
from .settings import Settings
from .shared import open_shared
from .store import OperatorStore, blas

log = logging.getLogger("kjit.service")

DESCRIPTION = """
Learned expectation-propagation message operators over HTTP.

* `POST /v1/operators/{name}/messages?mode=predict|jit|oracle` — outgoing messages and beliefs for a batch
  of incoming messages, with the log predictive variance and, per row, whether the oracle answered;
* `POST /v1/operators/{name}/observations` — add (incoming, belief) pairs computed elsewhere;
* `POST /v1/operators` — train a new operator (background job, `GET /v1/jobs/{id}`);
* `GET /metrics` — Prometheus.

Every error is `{"detail": [{"loc": [...], "msg": ..., "type": ...}]}` with `loc` naming the field.
Numbers must be finite (JSON has no NaN: `NaN`/`Infinity` tokens are rejected with 422).
Requests that change state (`mode=jit`, observations, training) need `Authorization: Bearer <token>` when the
server has a token (`KJIT_TOKEN`).  Updates are on disk before the response is sent.
"""


#: the bearer scheme's name in OpenAPI (service.app._security)
_BEARER = "HTTPBearer"


def _document_bodies(app: FastAPI, settings: Settings) -> None:
    """OpenAPI as the server behaves: the request bodies parsed by service.validation (not by
    FastAPI) registered as components, with this server's limits (a request beyond them is a
    422); security per operation as ``AuthMiddleware`` enforces it (a token only where
    ``is_mutating`` says so: messages need it for ``mode=jit|oracle``, not for ``predict``)."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            comps = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in (schemas.MessagesRequest, schemas.ObservationsRequest, schemas.TrainRequest):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            _limits(comps, settings)
            _security(spec, settings)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


def _limits(comps: dict, settings: Settings) -> None:
    def cap(model: str, field: str, limit: int) -> None:
        js = comps[model]
        p = js["properties"][field]
        p["maximum"] = min(p.get("maximum", limit), limit)
        if p.get("default", 0) > p["maximum"]:  # this server's limit is below the default: the field is required
            p.pop("default")
            js.setdefault("required", []).append(field)

    for src in ("OracleSource", "FileSource"):
        cap(src, "n_samples", settings.max_n_samples)
    cap("OracleSource", "n", settings.max_train_n)
    cap("TrainRequest", "n_inner", settings.max_n_inner)
    cap("TrainRequest", "n_outer", settings.max_n_outer)
    for name, js in comps.items():  # message batches: at most max_batch rows
        if name.endswith("Batch"):
            for col, p in js["properties"].items():
                if p.get("type") == "array":
                    p["maxItems"] = settings.max_batch


def _security(spec: dict, settings: Settings) -> None:
    from .middleware import is_mutating

    if settings.token is not None:
        spec["components"].setdefault("securitySchemes", {})[_BEARER] = {
            "type": "http", "scheme": "bearer",
            "description": "KJIT_TOKEN: needed by the requests that change state, and by mode=oracle"}

    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            if not isinstance(op, dict):
                continue
            concrete = path.replace("{name}", "x").replace("{job_id}", "x")
            if settings.token is None:  # no token: nothing is ever refused with a 401
                op.pop("security", None)
                op.get("responses", {}).pop("401", None)
            elif path == "/v1/operators/{name}/messages":  # (not a draw's messages: read-only, no token)
                # the token is needed for mode=jit (the default) and mode=oracle, not for mode=predict
                op["security"] = [{}, {_BEARER: []}]
            elif is_mutating(method.upper(), concrete, b""):
                op["security"] = [{_BEARER: []}]
            else:
                op.pop("security", None)
                op.get("responses", {}).pop("401", None)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the store is opened (and its operators loaded, in the background) at startup."""
    settings = settings if settings is not None else Settings.from_env()
    settings.import_factors()  # --factors / KJIT_FACTORS: before any operator is loaded
    metrics = Metrics()
    store = OperatorStore(settings.store, snapshot_every=settings.snapshot_every, observer=metrics.observe_store,
                          shared=open_shared(settings.shared_store) if settings.shared_store else None,
                          merge_interval=settings.merge_interval)
    metrics.store = store
    # the continuous audit (service/audit.py): off unless KJIT_AUDIT_RATE > 0
    store.audit = (Auditor(settings.audit_rate, cpu_share=settings.audit_cpu_share, kl_target=settings.audit_kl_target,
                           min_audits=settings.audit_min_audits, max_queue=settings.audit_queue,
                           batch=settings.audit_batch) if settings.audit_rate > 0 else None)
    metrics.registry.register(AuditCollector(store))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        restore_blas = blas.set_threads(settings.blas_threads)  # (for the app's lifetime)
        try:
            store.open()
            app.state.jobs = JobManager(store, workers=settings.job_workers, metrics=metrics)
            loader = threading.Thread(target=store.load_all, name="kjit-load", daemon=True)
            loader.start()
            if store.audit is not None:
                store.audit.start()
            try:
                yield
            finally:
                app.state.jobs.shutdown()
                loader.join(timeout=120)
                if store.audit is not None:  # rows still queued were never counted: nothing is lost
                    store.audit.stop()
                store.close()
        finally:
            if restore_blas is not None:
                restore_blas()

    app = HotPathApp(title="kjit message-operator service", version=kjit_version, description=DESCRIPTION,
                  lifespan=lifespan)
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = metrics
    app.state.oracle_slots = threading.BoundedSemaphore(settings.oracle_concurrency)
    app.state.oracle_slot = oracle_slot(app.state.oracle_slots, settings)
    errors.install(app)
    app.include_router(router)
    _document_bodies(app, settings)
    # added last = outermost: metrics, then authentication, then the body limit, then the
    # one-message hot path (service/fastpath.py)
    app.add_middleware(PredictFastPath)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, token=settings.token)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
