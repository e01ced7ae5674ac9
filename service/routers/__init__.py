"""The HTTP API, one router per resource: health (liveness, readiness, metrics), operators
(list, describe, create), messages (messages and observations), jobs, replicas.  What a route
needs comes from :mod:`service.deps`; messages on the wire from :mod:`service.wire`."""

from __future__ import annotations

from fastapi import APIRouter

from . import health, jobs, messages, operators, replicas

router = APIRouter()
for _module in (health, operators, messages, replicas, jobs):
    router.include_router(_module.router)

__all__ = ["router"]
