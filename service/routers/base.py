"""What every router shares: the documented error answers, JSON responses, row errors."""

from __future__ import annotations

import json

import pydantic_core
from fastapi import Response

from .. import schemas
from ..errors import ApiError
from ..jobs import scrub
from ..store import OperatorStore, body_hash

ERRORS = {
    400: {"model": schemas.ErrorResponse, "description": "the body is not JSON (its Content-Type names another media "
                                                         "type)"},
    401: {"model": schemas.ErrorResponse, "description": "missing or invalid bearer token"},
    404: {"model": schemas.ErrorResponse, "description": "unknown operator"},
    408: {"model": schemas.ErrorResponse, "description": "the request's headers or body did not arrive in time "
                                                         "(the connection is closed)"},
    413: {"model": schemas.ErrorResponse, "description": "request body too large"},
    422: {"model": schemas.ErrorResponse, "description": "invalid request; `loc` names the field"},
    429: {"model": schemas.ErrorResponse, "description": "busy (oracle slots or training queue full); see Retry-After"},
    431: {"model": schemas.ErrorResponse, "description": "request line and headers too large (the connection is "
                                                         "closed)"},
    503: {"model": schemas.ErrorResponse, "description": "operator loading or update not persisted"},
}


def answers(model, status: int = 200, description: str = "OK", headers: dict | None = None, **more) -> dict:
    """OpenAPI ``responses``: the success answer's model (documentation only: the routes encode their answers
    themselves, and the Schemathesis contract test checks that they match) and the error answers."""
    ok = {"model": model, "description": description}
    if headers:
        ok["headers"] = headers
    return {status: ok, **{k: v for k, v in ERRORS.items() if k != 400 or more.pop("body", False)}, **more}


def request_body(model) -> dict:
    """OpenAPI: the body is parsed by :func:`service.validation.parse_body`, not by FastAPI
    (bounded memory, strict numbers); the schema is registered in ``app.openapi``."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def json_response(payload, status: int = 200, headers=None) -> Response:
    # pydantic_core's encoder: ~10x faster than json.dumps on long float lists, and exact (shortest
    # round-trip repr); non-finite values were mapped to null by service.wire, "null" is only a safety net
    return Response(pydantic_core.to_json(payload, inf_nan_mode="null"), status_code=status,
                    media_type="application/json", headers=headers)


def row_errors(rows, where: list, what: str, type_: str) -> ApiError:
    return ApiError.many(422, [{"loc": where + [int(i)], "type": type_, "msg": f"row {int(i)}: {what}"}
                               for i in rows])


def canonical_hash(req) -> str:
    """Hash of the request's canonical JSON (sorted keys, floats as parsed): re-serialising the
    same request gives the same Idempotency-Key fingerprint."""
    text = json.dumps(req.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return body_hash(text.encode())


def failed(store: OperatorStore) -> dict:
    """Why operators failed, without the server's paths (the full text is in the log)."""
    return {k: scrub(v, store.root) for k, v in dict(store.failed).items()}
