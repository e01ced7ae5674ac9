"""Replicas sharing one ordered update log (``KJIT_SHARED_STORE``, :mod:`service.shared`)."""

from __future__ import annotations

from fastapi import APIRouter

from .. import schemas
from ..deps import EntryDep
from ..errors import ApiError, internal_error
from ..shared import SharedLogError
from ..store import Conflict
from .base import answers, json_response

router = APIRouter(tags=["replicas"])


@router.post(
    "/v1/operators/{name}/merge", response_model=None,
    responses=answers(schemas.MergeResponse, **{
        "409": {"model": schemas.ErrorResponse, "description": "this server is not a replica"}}),
    summary="replicas: apply the other replicas' updates from the shared store now",
    description=("A replica (`KJIT_SHARED_STORE`) merges every `KJIT_MERGE_INTERVAL` seconds on its own and before "
                 "every update it takes; this applies the shared log's records up to its current end now. "
                 "Replicas at the same `version` predict bit for bit identically."),
)
def merge(entry: EntryDep):
    try:
        merged = entry.merge()
        length = entry.shared.length(entry.name)
    except Conflict as exc:
        raise ApiError(409, ["path", "name"], str(exc), "not_replicated") from None
    except SharedLogError as exc:
        raise ApiError(503, [], f"the shared store is unavailable: {exc}", "shared_store_unavailable") from None
    except ValueError as exc:
        raise internal_error("the shared log could not be applied; the operator is reported failed", exc, 503,
                             "shared_log_damaged") from None
    return json_response({"operator": entry.name, "merged": merged, "version": entry.version, "shared_length": length})
