"""The one-message hot path: ``POST /v1/operators/{name}/messages?mode=predict`` answered without
FastAPI's routing and dependency resolution.

An EP loop with a sequential schedule sends one message per call, and FastAPI's part of such a
call (nested routers matched in turn, seven dependencies solved, the request re-wrapped) was
~0.4 ms of a ~2 ms request, a fifth of it (issue 17).  :class:`PredictFastPath` is the innermost
ASGI middleware (inside metrics, authentication and the body limit, which apply unchanged):
a request whose query string is exactly ``mode=predict`` on the messages route's own path
pattern is answered by the same functions the route uses — the dependencies of
:mod:`service.deps` called directly (:func:`get_entry`: 404 / 503 as the route), the body parser
the route depends on, and :func:`service.routers.messages.answer` — with the route's error
handler for an :class:`ApiError`.  Anything else (another mode, extra query parameters, a
``root_path``) goes to FastAPI.  tests/test_fastpath.py checks that both paths give the same
status, headers and body on successes and on every kind of error.
"""

from __future__ import annotations

from starlette.requests import Request

from . import schemas
from .deps import get_entry, get_oracle_slot
from .errors import ApiError, api_error_handler
from .routers.messages import answer, messages, router as messages_router
from .validation import body_dependency

__all__ = ["PredictFastPath"]

#: the only query string the hot path answers (everything else is FastAPI's)
_QUERY = b"mode=predict"


def _route():
    return next(r for r in messages_router.routes if getattr(r, "endpoint", None) is messages)


class PredictFastPath:
    """ASGI middleware; see the module's docstring."""

    def __init__(self, app):
        self.app = app
        self.route = _route()
        self.parse = body_dependency(schemas.MessagesRequest)

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] != "POST" or scope.get("query_string") != _QUERY
                or scope.get("root_path")):
            return await self.app(scope, receive, send)
        m = self.route.path_regex.match(scope["path"])
        if m is None:
            return await self.app(scope, receive, send)
        name = self.route.param_convertors["name"].convert(m.group("name"))
        scope["route"] = self.route  # what the metrics label the request with
        scope["path_params"] = {"name": name}
        request = Request(scope, receive)
        state = request.app.state
        try:
            entry = await get_entry(request, name)
            req = await self.parse(request)
            response = await answer(entry, state.settings, state.store, state.metrics,
                                    await get_oracle_slot(request), req, "predict")
        except ApiError as exc:
            response = await api_error_handler(request, exc)
        await response(scope, receive, send)
