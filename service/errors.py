"""One error shape for every 4xx/5xx: ``{"detail": [{"loc": [...], "msg": "...", "type": "..."}]}``.

``loc`` names the field (``["body", "incoming", "x", "var", 3]``, ``["path", "name"]``,
``["query", "mode"]``, ``["header", "authorization"]``), as FastAPI does for validation
errors; the request's input is never echoed back (a rejected 10 000-message batch would
otherwise come back whole).
"""

from __future__ import annotations

import json
import logging
import re
import uuid

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kjit.errors import QUOTE_LIMIT
from kjit.families import FAMILIES

log = logging.getLogger("kjit.service")

#: most error items in one response (the first ones; ``error_count`` gives the total)
MAX_ERRORS = 20


class ApiError(Exception):
    def __init__(self, status: int, loc, msg: str, type: str, headers: dict | None = None):
        self.status = status
        self.items = [{"loc": list(loc), "msg": msg, "type": type}]
        self.headers = headers
        super().__init__(msg)

    @classmethod
    def many(cls, status: int, items: list[dict], headers: dict | None = None) -> "ApiError":
        e = cls(status, items[0]["loc"], items[0]["msg"], items[0]["type"], headers)
        e.items = items
        return e


def _bounded_loc(item: dict) -> dict:
    """The item with each key of its ``loc`` cut to :data:`kjit.errors.QUOTE_LIMIT` characters (a key the
    client sent, such as an unknown field's name, is quoted, not echoed whole)."""
    loc = item.get("loc")
    if loc and any(isinstance(x, str) and len(x) > QUOTE_LIMIT for x in loc):
        item = {**item, "loc": [x[:QUOTE_LIMIT] + "…" if isinstance(x, str) and len(x) > QUOTE_LIMIT else x
                                for x in loc]}
    return item


def _payload(items) -> dict:
    items = list(items)
    out = {"detail": [_bounded_loc(i) for i in items[:MAX_ERRORS]]}
    if len(items) > MAX_ERRORS:
        out["error_count"] = len(items)
    return out


def error_body(items) -> bytes:
    return json.dumps(_payload(items), default=str).encode()


def error_response(status: int, items, headers=None) -> JSONResponse:
    return JSONResponse(_payload(items), status_code=status, headers=headers)


_FAMILY_TAGS = set(FAMILIES)  # the discriminator tags of message batches
_SOURCE_TAGS = {"oracle", "file", "client"}
#: the labels pydantic puts in ``loc`` for the members of an untagged union (``literal['default']``,
#: ``dict[str,dict[str,ParamRange]]``, after a training source's ``distribution``): not fields of the body
_UNION_LABEL = re.compile(r"^[A-Za-z_]+\[.*\]$").match


def _strip_tags(loc: list) -> list:
    """Drop the discriminator tags pydantic puts in ``loc`` for tagged unions:
    ``body.incoming.x.gaussian.var.1`` → ``body.incoming.x.var.1``."""
    out = []
    for i, x in enumerate(loc):
        if x in _FAMILY_TAGS and ((i >= 2 and loc[i - 2] == "incoming" and loc[0] == "body")
                                  or (i >= 1 and loc[i - 1] == "beliefs")):
            continue
        if x in _SOURCE_TAGS and i >= 1 and loc[i - 1] == "source":
            continue
        if i >= 1 and loc[i - 1] == "distribution" and isinstance(x, str) and _UNION_LABEL(x):
            continue  # (the one untagged union of a request; found by an audit: loc named no field of the body)
        out.append(x)
    return out


_BOUNDS = {"less_than_equal": ("le", "less than or equal to"), "greater_than_equal": ("ge", "greater than or equal to"),
           "less_than": ("lt", "less than"), "greater_than": ("gt", "greater than")}


def _clean(err: dict, prefix=()) -> dict:
    loc = list(prefix) + [x if isinstance(x, (str, int)) else str(x) for x in err.get("loc", ())]
    out = {"loc": _strip_tags(loc), "msg": err.get("msg", ""), "type": err.get("type", "invalid")}
    ctx = err.get("ctx") or {}
    if out["type"] == "json_invalid":
        out["loc"] = out["loc"] or ["body"]
        if ctx.get("error"):
            out["msg"] = f"malformed JSON: {ctx['error']}"
    elif out["type"] in _BOUNDS:
        key, words = _BOUNDS[out["type"]]
        if isinstance(ctx.get(key), (int, float)):
            out["msg"] = f"Input should be {words} {float(ctx[key]):g}"
    return out


def clean_errors(errors, prefix=()) -> list[dict]:
    return [_clean(e, prefix) for e in errors]


async def api_error_handler(request: Request, exc: ApiError):
    return error_response(exc.status, exc.items, exc.headers)


async def validation_handler(request: Request, exc: RequestValidationError):
    return error_response(422, [_clean(e) for e in exc.errors()])


def allowed_methods(app, path: str) -> list[str]:
    """The methods the API serves on ``path``, from its OpenAPI paths (HEAD is not served: FastAPI's
    GET routes answer it 405, so an ``Allow`` listing it was wrong — found in review)."""
    from starlette.routing import compile_path

    out = set()
    for template, ops in app.openapi().get("paths", {}).items():
        if compile_path(template)[0].match(path):
            out |= {m.upper() for m in ops if m.lower() in _HTTP_METHODS}
    return sorted(out)


_HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


async def http_exception_handler(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        items = [{"loc": ["path"], "msg": f"no route {request.method} {request.url.path}", "type": "not_found"}]
    elif exc.status_code == 405:
        items = [{"loc": ["method"], "msg": f"method {request.method} not allowed on {request.url.path}",
                  "type": "method_not_allowed"}]
        # Starlette's Allow names the methods of the first route that matched the path; a path
        # served by several routes (GET and POST /v1/operators) allows all of theirs
        allowed = allowed_methods(request.app, request.url.path)
        if allowed:
            return error_response(405, items, {"Allow": ", ".join(allowed)})
    else:
        items = [{"loc": [], "msg": str(exc.detail), "type": "http_error"}]
    return error_response(exc.status_code, items, getattr(exc, "headers", None))


def internal_error(what: str, exc: BaseException | None = None, status: int = 500, type_: str = "internal_error"):
    """An ApiError for a server-side failure: the details go to the log, the client gets an id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s (error_id %s)", what, error_id, exc_info=exc)
    return ApiError(status, [], f"{what} (error_id {error_id}; details in the server log)", type_)


async def unhandled_handler(request: Request, exc: Exception):
    error_id = uuid.uuid4().hex[:12]
    log.error("unhandled error in %s %s (error_id %s)", request.method, request.url.path, error_id, exc_info=exc)
    return error_response(500, [{"loc": [], "msg": f"internal error (error_id {error_id}; details in the server log)",
                                 "type": "internal_error"}])


def install(app) -> None:
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, unhandled_handler)
