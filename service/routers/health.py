"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response

from kjit import __version__ as kjit_version

from .. import schemas
from ..deps import MetricsDep, StoreDep
from .base import failed, json_response

router = APIRouter(tags=["health"])


@router.get("/health", summary="liveness: the process answers", response_model=schemas.Health)
async def health():  # on the event loop: answers even when the thread pool is busy
    return {"status": "ok", "kjit_version": kjit_version}


@router.get("/ready", summary="readiness: every operator of the store is loaded",
            response_model=None, responses={200: {"model": schemas.Ready, "description": "every operator is loaded"},
                                            503: {"model": schemas.Ready,
                                                  "description": "still loading, or an operator failed to load"}})
def ready(store: StoreDep):
    waiting = store.loading | store.retry
    body = {"ready": store.loaded and not store.failed and not waiting, "operators": store.names(),
            "loading": sorted(waiting), "failed": failed(store)}
    if store.missing_factors:  # operator → the factor it needs that this server does not have
        body["missing_factors"] = dict(store.missing_factors)
    loss = {name: e.log.possible_loss for name, e in list(store.entries.items()) if e.log.possible_loss}
    if loss:  # operator → a record its load cut that may have been acknowledged (served on: the rest is intact)
        body["possible_loss"] = loss
    return json_response(body, 200 if body["ready"] else 503)


@router.get("/metrics", summary="Prometheus metrics (text format)", response_class=Response)
def metrics(registry: MetricsDep):
    from ..metrics import CONTENT_TYPE

    return Response(registry.render(), media_type=CONTENT_TYPE)
