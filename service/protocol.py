"""uvicorn's httptools protocol, with a response's head and body written to the socket together.

uvicorn writes a response's status line and headers as soon as the app sends
``http.response.start`` and the body when it sends ``http.response.body``: two writes, and on
loopback two TCP segments, each waking the client (with ``TCP_NODELAY``, which uvicorn sets).
A one-message answer is a few hundred bytes, so that second wake-up is a fair part of the round
trip (issue 17; the client's side does the same for requests: :class:`kjit.transport._Connection`).
:class:`OneWriteHttpToolsProtocol` gives uvicorn's protocol a transport that holds a response
head (a write that is a complete ``HTTP/1.x`` status line and header block) until the next write
— the body, normally in the same step of the app's task — and sends both in one write.  Nothing
waits on the body: a held head is written at the latest on the event loop's next iteration (a
streamed or slow body), before a close or ``write_eof``, and is dropped only by ``abort``, which
drops the transport's own buffer too.  Bytes and their order on the wire are unchanged.

A request's head is bounded (found by an audit: uvicorn's httptools protocol has no limit, and
httptools joins a header's pieces one read at a time — a 64 MiB header was answered 200 after
3.5 s, 256 MiB after 67 s and +500 MB, the event loop stalled throughout): the bytes read while
a request's head is incomplete are summed per read (no per-byte work), and beyond
``max_head_bytes`` (``KJIT_MAX_HEAD_BYTES``) the request is answered 431 and the connection
closed.  A head that completes within the read that crossed the bound is measured exactly (its
URL and headers) before it is refused.

A request must also arrive in time (found by an audit: connections that sent nothing, stopped
mid-head or stalled mid-body were never closed, and 1 100 of them under ``ulimit -n 1024`` locked
every client out for as long as they stayed open).  A connection's first head, and each head
after its first byte, must be complete within ``head_timeout`` seconds (``KJIT_HEAD_TIMEOUT``);
a body must arrive within ``body_timeout`` seconds (``KJIT_BODY_TIMEOUT``) of its head plus one
second per ``min_body_rate`` bytes received (``KJIT_MIN_BODY_RATE``): a stall, or a trickle
slower than that rate, is answered 408 and the connection closed (closed without an answer when
the connection sent nothing yet, or when the app already answered).  Time the server itself
makes a request wait — reading paused while the app is busy, a pipelined request behind an
answer in progress — does not count.  Idle keep-alive connections are uvicorn's
(``timeout_keep_alive``).  The timers cost nothing per byte: a request whose head (and body)
arrive in the read that starts it arms none; others arm one per phase.

:meth:`OneWriteHttpToolsProtocol.with_limits` gives the class with the service's settings
(``service.server.uvicorn_config``).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import error_body

__all__ = ["OneWriteHttpToolsProtocol", "HeadHoldingTransport"]


def _is_head(data) -> bool:
    return data[:7] == b"HTTP/1." and data[-4:] == b"\r\n\r\n"


class HeadHoldingTransport:
    """A proxy of an asyncio transport whose ``write`` holds a response head until the next write
    (see the module's docstring); every other attribute is the transport's."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held = None

    def write(self, data) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + bytes(data))
        elif _is_head(data) and not self._transport.is_closing():
            self._held = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write a held head now (a no-op when none is held)."""
        held, self._held = self._held, None
        if held is not None:
            self._transport.write(held)

    def writelines(self, data) -> None:
        self.flush()
        self._transport.writelines(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name):
        return getattr(self._transport, name)


def _error_answer(status: int, items, default_headers=(), close: bool = True) -> bytes:
    """A whole error response (the service's error body), for the protocol to write itself."""
    body = error_body(items)
    head = [STATUS_LINE[status]]
    for name, value in default_headers:
        head += [name, b": ", value, b"\r\n"]
    head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
    if close:
        head.append(b"connection: close\r\n")
    return b"".join(head) + b"\r\n" + body


def _too_slow(where: str, what: str) -> list[dict]:
    return [{"loc": [where], "type": "request_timeout", "msg": what}]


def _head_too_large(limit: int) -> list[dict]:
    return [{"loc": ["header"], "type": "header_too_large",
             "msg": f"the request line and headers exceed the limit of {limit} bytes (KJIT_MAX_HEAD_BYTES)"}]


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a :class:`HeadHoldingTransport`, with a bounded request head
    (see the module's docstring); pass the class, or :meth:`with_limits`'s, as ``uvicorn.Config(http=...)``."""

    #: most bytes of a request line and headers (431 and close beyond); ``Settings.max_head_bytes``
    max_head_bytes: int = 64 * 1024
    #: seconds from a connection's start, or a request's first byte, to the end of its head (408 and close after)
    head_timeout: float = 10.0
    #: seconds a body may take beyond one per ``min_body_rate`` bytes received (408 and close after)
    body_timeout: float = 30.0
    #: bytes per second a body must keep up, on average, once ``body_timeout`` has passed
    min_body_rate: float = 16 * 1024

    @classmethod
    def with_limits(cls, **limits) -> type:
        """This class with other limits (class attributes of the same names)."""
        unknown = [k for k in limits if not hasattr(cls, k) or k.startswith("_")]
        if unknown:
            raise TypeError(f"unknown limit(s) {', '.join(unknown)}")
        return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__, **limits})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0  # bytes read since the last head completed (reads that began before the body)
        self._in_head = False  # between a request's first byte and its head's end
        self._in_body = False  # between a head's end and its message's end
        self._timer: asyncio.TimerHandle | None = None  # the deadline of the head or body being read
        self._body_start = 0.0  # when the body's deadline was armed (loop time)
        self._body_bytes = 0  # bytes read since then

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(HeadHoldingTransport(transport, self.loop))
        self._timer = self.loop.call_later(self.head_timeout, self._expired)  # a connection that sends nothing

    def connection_lost(self, exc) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        if self._in_body:
            self._body_bytes += len(data)
        else:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_body:
            if self._timer is None:  # a body that did not come whole with its head
                self._arm_body(self.loop.time())
        elif self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self._refuse_head()  # a head still incomplete after more than the bound
        elif self._in_head and self._timer is None:  # a head that did not come whole in one read
            self._timer = self.loop.call_later(self.head_timeout, self._expired)

    def _arm_body(self, now: float) -> None:
        """The body's deadline counted from ``now``, its bytes from 0."""
        self._body_start, self._body_bytes = now, 0
        self._timer = self.loop.call_at(now + self.body_timeout, self._expired)

    def _expired(self) -> None:
        """A head's or body's deadline passed: 408 and close, unless the wait was the server's."""
        self._timer = None
        if self.transport.is_closing():
            return
        now, cycle = self.loop.time(), self.cycle
        if self._in_body:
            if self.flow.read_paused or getattr(cycle, "waiting_for_100_continue", False):
                # the app has not taken what was read (or a pipelined request waits), or the client waits
                # for the 100 Continue the app's first receive() sends (found in review: a wait of the app's
                # before reading counted against the client)
                self._arm_body(now)
                return
            due = self._body_start + self.body_timeout + self._body_bytes / self.min_body_rate
            if now < due:
                self._timer = self.loop.call_at(due, self._expired)
                return
            if cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # the app's receive() sees a disconnect; nothing more is written
                cycle.message_event.set()
                self.transport.write(_error_answer(408, _too_slow("body", (
                    f"the request body did not arrive in time ({self.body_timeout:g} s plus one second per "
                    f"{self.min_body_rate:g} bytes received: KJIT_BODY_TIMEOUT, KJIT_MIN_BODY_RATE)")),
                    self.server_state.default_headers))
        elif cycle is not None and not cycle.response_complete:  # the client waits on an answer in progress
            self._timer = self.loop.call_later(self.head_timeout, self._expired)
            return
        elif self._in_head:
            self.transport.write(_error_answer(408, _too_slow("header", (
                f"the request line and headers did not arrive within {self.head_timeout:g} s "
                f"(KJIT_HEAD_TIMEOUT)")), self.server_state.default_headers))
        self.transport.close()  # (a connection that sent nothing is closed without an answer)

    def _refuse_head(self) -> None:
        """431 and close for a request whose head is still incomplete beyond the bound."""
        self._head_bytes = 0
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # a pipelined request's head: the answer in progress goes out first, then the connection closes
            cycle.keep_alive = False
            self.flow.pause_reading()
            return
        self.transport.write(_error_answer(431, _head_too_large(self.max_head_bytes),
                                           self.server_state.default_headers))
        self.transport.close()

    def _head_size(self) -> int:
        """The bytes of the request line and headers just parsed (method and version: at most 24)."""
        return len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers) + 24

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_timer()
        if self._head_bytes > self.max_head_bytes and self._head_size() > self.max_head_bytes:
            # (checked only when this read took the count beyond the bound: a body in the read counts too)
            app, self.app = self.app, _HeadTooLargeApp(self.max_head_bytes)
            try:
                super().on_headers_complete()  # answered by the 431 app (connection: close)
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        self._head_bytes = 0
        self._in_body = True

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_body = False
        self._cancel_timer()


class _HeadTooLargeApp:
    """The ASGI app that answers a request whose head was too large (431, connection: close)."""

    def __init__(self, limit: int):
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        body = error_body(_head_too_large(self.limit))
        await send({"type": "http.response.start", "status": 431,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
