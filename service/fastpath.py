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

:class:`HotPathApp` (the service's FastAPI class) also takes such a request past FastAPI's own
outer layers — its ``__call__``, the native-telemetry check, Starlette's ``__call__``, the
telemetry and body-size middlewares that do nothing here (~20 µs of a one-message request): it
runs the request through a second stack made of the same pieces — Starlette's
``ServerErrorMiddleware`` with the app's handler for unhandled errors, then the app's own
middleware in the same order (metrics, authentication, body limit), then this path.  Only
while FastAPI's native telemetry is off (no OpenTelemetry provider configured: it would trace
the request) and no ``root_path`` is set on the app; an app whose middleware has no
:class:`PredictFastPath` has no second stack.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.datastructures import State
from starlette.requests import Request

from . import schemas
from .deps import get_entry, get_oracle_slot
from .errors import ApiError, api_error_handler
from .middleware import trusted
from .routers.messages import answer, messages, router as messages_router
from .validation import body_dependency

__all__ = ["PredictFastPath", "HotPathApp"]

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

    def takes(self, scope):
        """The operator name if this path answers the request, else None."""
        if (scope["type"] != "http" or scope["method"] != "POST" or scope.get("query_string") != _QUERY
                or scope.get("root_path")):
            return None
        m = self.route.path_regex.match(scope["path"])
        return None if m is None else m.group("name")

    async def __call__(self, scope, receive, send):
        name = self.takes(scope)
        if name is None:
            return await self.app(scope, receive, send)
        name = self.route.param_convertors["name"].convert(name)
        scope["route"] = self.route  # what the metrics label the request with
        scope["path_params"] = {"name": name}
        request = Request(scope, receive)
        state = request.app.state
        try:
            entry = await get_entry(request, name)
            req = await self.parse(request)
            response = await answer(entry, state.settings, state.store, state.metrics,
                                    await get_oracle_slot(request), req, "predict", audit=trusted(scope))
        except ApiError as exc:
            response = await api_error_handler(request, exc)
        await response(scope, receive, send)


class AppState(State):
    """``app.state`` whose attributes read as plain attributes.  Starlette's ``State`` answers a
    read from ``__getattr__``, which Python calls only after the normal look-up has raised — and
    formatted — an ``AttributeError``: ~1 µs for each of the ~6 reads of a one-message request.
    Here a value set through the state (attribute or item) is kept in the state's dict (what
    ``State``'s item access and iteration read) and, under a string key, as an instance attribute,
    so a read finds it directly.  (Writes go through the state, not into its dict.)"""

    def __init__(self, state=None):
        super().__init__(state)
        for key, value in self._state.items():
            self._mirror(key, value)

    def _mirror(self, key, value) -> None:
        if type(key) is str and key != "_state":  # (State's own dict keeps its name)
            object.__setattr__(self, key, value)

    def __setattr__(self, key, value) -> None:
        super().__setattr__(key, value)
        self._mirror(key, value)

    def __delattr__(self, key) -> None:
        super().__delattr__(key)
        if type(key) is str and key != "_state":
            self.__dict__.pop(key, None)

    def __setitem__(self, key, value) -> None:
        self.__setattr__(key, value)

    def __delitem__(self, key) -> None:
        self.__delattr__(key)


class HotPathApp(FastAPI):
    """FastAPI, with requests that :class:`PredictFastPath` answers sent through a shorter stack of
    the same pieces (see the module's docstring), and an :class:`AppState` as ``app.state``."""

    _hot = None  # (the PredictFastPath of the second stack, the stack), built with the main one

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        state = AppState()
        for key in self.state:  # (whatever the base classes put there)
            state[key] = self.state[key]
        self.state = state

    def build_middleware_stack(self):
        stack = super().build_middleware_stack()
        self._hot = None
        layers = list(self.user_middleware)
        i = next((k for k, m in enumerate(layers) if m.cls is PredictFastPath), None)
        if i is not None:
            handler = None  # the handler of unhandled errors, chosen as Starlette's stack chooses it
            for key, h in self.exception_handlers.items():
                if key in (500, Exception):
                    handler = h
            fast = app = PredictFastPath(stack, *layers[i].args, **layers[i].kwargs)
            for cls, args, kwargs in reversed(layers[:i]):
                app = cls(app, *args, **kwargs)
            self._hot = (fast, ServerErrorMiddleware(app, handler=handler, debug=self.debug))
        return stack

    async def __call__(self, scope, receive, send):
        if self.middleware_stack is None:
            self.middleware_stack = self.build_middleware_stack()
        hot = self._hot
        if hot is not None and not self.root_path and hot[0].takes(scope) is not None and not _telemetry(self):
            scope["app"] = self
            await hot[1](scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _telemetry(app) -> bool:
    """Whether FastAPI's native telemetry would trace this request (FastAPI ≥ 0.165)."""
    t = getattr(app, "_native_telemetry", None)
    return t is not None and t.enabled()
