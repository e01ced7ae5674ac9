"""What a route needs from the app, as ``Annotated`` dependencies: the settings, the store, one
operator, the jobs, the metrics, a slot for oracle work.

They are ``async``: FastAPI runs a sync dependency in the thread pool, one thread hop each
(measured: most of a one-message request's server time under load).  The app's factory
(:func:`service.app.create_app`) puts what they return on ``app.state``; the routes read it only
through these.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Annotated, Callable, ContextManager

from fastapi import Depends, Path, Request
from starlette.concurrency import run_in_threadpool

from .errors import ApiError
from .jobs import JobManager, scrub
from .metrics import Metrics
from .settings import Settings
from .store import Entry, NotFound, NotReady, OperatorStore

__all__ = ["SettingsDep", "StoreDep", "EntryDep", "JobsDep", "MetricsDep", "OracleSlotDep"]


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> OperatorStore:
    return request.app.state.store


async def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def _entry(store: OperatorStore, name: str) -> Entry:
    try:
        return store.get(name)
    except NotFound as exc:
        raise ApiError(404, ["path", "name"], str(exc), "not_found") from None
    except NotReady as exc:
        raise ApiError(503, ["path", "name"], scrub(str(exc), store.root), "not_ready", {"Retry-After": "1"}) from None


async def get_entry(request: Request, name: Annotated[str, Path(description="operator name")]) -> Entry:
    store: OperatorStore = request.app.state.store
    entry = store.entries.get(name)  # a served operator: a dict look-up, no I/O
    if entry is not None:
        return entry
    # unknown, loading, or (a replica) to be adopted from the shared store: may do I/O
    return await run_in_threadpool(_entry, store, name)


def oracle_slot(sem: threading.Semaphore, settings: Settings) -> Callable[[], ContextManager[None]]:
    """A context manager holding one of ``KJIT_ORACLE_CONCURRENCY`` slots (``sem``) for oracle
    work; 429 after ``KJIT_ORACLE_WAIT`` s.  Built once per app (``app.state.oracle_slot``)."""

    @contextmanager
    def slot():
        if not sem.acquire(timeout=settings.oracle_wait):
            raise ApiError(429, [], f"the oracle is busy ({settings.oracle_concurrency} request(s) at a time, "
                                    f"KJIT_ORACLE_CONCURRENCY); retry later", "oracle_busy", {"Retry-After": "2"})
        try:
            yield
        finally:
            sem.release()

    return slot


async def get_oracle_slot(request: Request) -> Callable[[], ContextManager[None]]:
    """The app's :func:`oracle_slot`."""
    return request.app.state.oracle_slot


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[OperatorStore, Depends(get_store)]
EntryDep = Annotated[Entry, Depends(get_entry)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
OracleSlotDep = Annotated[Callable[[], ContextManager[None]], Depends(get_oracle_slot)]
