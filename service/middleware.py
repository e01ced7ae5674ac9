"""Pure ASGI middleware: metrics, bearer-token check, request-body size limit.

Order (outermost first): metrics → authentication → body limit → the app.  The token is
checked before any of the body is read, so an unauthenticated client cannot make the server
buffer a large body; the size limit is enforced on the ``Content-Length`` header and again
while reading (chunked bodies), before FastAPI parses anything.
"""

from __future__ import annotations

import hmac
import time
from urllib.parse import parse_qs

from .errors import error_body

_NO_BODY = {"GET", "HEAD", "OPTIONS", "DELETE"}


async def _send_error(send, status: int, items, headers=()) -> None:
    body = error_body(items)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def is_mutating(method: str, path: str, query_string: bytes) -> bool:
    """Requests that need the token: those that can change an operator or the store, and
    ``mode=oracle`` (expensive)."""
    if method != "POST":
        return False
    parts = [p for p in path.split("/") if p]
    if parts == ["v1", "operators"]:
        return True  # a training job
    if len(parts) == 4 and parts[:2] == ["v1", "operators"]:
        if parts[3] in ("observations", "merge"):
            return True
        if parts[3] == "messages":
            mode = parse_qs(query_string.decode("latin-1")).get("mode", ["jit"])[-1]
            # jit learns; oracle reads only but costs the server real CPU: both need the token
            return mode in ("jit", "oracle")
    return False


class MetricsMiddleware:
    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            m = self.metrics
            m.child(m.requests, method, template, str(status["code"])).inc()
            m.child(m.latency, method, template).observe(time.perf_counter() - t0)


#: ``scope["state"]`` key set on a request that did not carry the server's token (only when one is configured)
UNTRUSTED = "kjit_untrusted"


def trusted(scope) -> bool:
    """Did the request carry the server's token, or does the server have none (the audit may learn its answers)."""
    state = scope.get("state")
    return not (state and state.get(UNTRUSTED))


class AuthMiddleware:
    def __init__(self, app, token: str | None):
        self.app = app
        self.token = token.encode() if token else None

    def _valid(self, auth: bytes) -> bool:
        scheme, _, given = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.token is None:
            return await self.app(scope, receive, send)
        auth = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                auth = v
                break
        if not is_mutating(scope["method"], scope["path"], scope.get("query_string", b"")):
            # open to all; whether it carried the token decides whether its answers may feed the
            # continuous audit, which learns them (service.audit; found by an audit: an unauthenticated
            # mode=predict moved an operator's threshold and training set)
            if auth is None or not self._valid(auth):
                scope.setdefault("state", {})[UNTRUSTED] = True
            return await self.app(scope, receive, send)
        challenge = [(b"www-authenticate", b'Bearer realm="kjit"')]
        if auth is None:
            return await _send_error(send, 401, [{
                "loc": ["header", "authorization"], "type": "missing_token",
                "msg": "this request changes server state or runs the oracle and needs "
                       "`Authorization: Bearer <token>`"}], challenge)
        if not self._valid(auth):
            return await _send_error(send, 401, [{
                "loc": ["header", "authorization"], "type": "invalid_token",
                "msg": "invalid bearer token"}], challenge + [(b"www-authenticate", b'Bearer error="invalid_token"')])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    def _too_large(self, n):
        return [{"loc": ["body"], "type": "body_too_large",
                 "msg": f"request body of {n} bytes exceeds the limit of {self.max_bytes} bytes "
                        f"(KJIT_MAX_BODY_BYTES); send smaller batches"}]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in _NO_BODY:
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    n = int(v)
                except ValueError:
                    n = -1
                if n > self.max_bytes:
                    return await _send_error(send, 413, self._too_large(n))
                break
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await _send_error(send, 413, self._too_large(f"more than {size}"))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        scope.setdefault("state", {})
        scope["state"]["raw_body"] = body
        await self.app(scope, replay, send)
