"""HTTP/1.1 for :class:`kjit.client.RemoteOperator`: one keep-alive connection, per-request
timeouts, and errors that say whether the request can have reached the server.

Why not httpx's client for this (httpx stays a dependency; ``RemoteOperator(client=httpx.Client(...))``
still takes one, for proxies or HTTP/2): a one-message request is a few hundred bytes each way, and
the client's own work dominates it.  Measured paired on one server (the same request alternating
between clients, 1 500 rounds, ``mode=predict`` of one message, D 500/1000): ``httpx.Client.post``
0.44 ms per request slower than the standard library's ``http.client`` on its own keep-alive
connection (2.32 vs 1.87 ms p50; httpcore's h11 and pool, httpx's models and cookie handling), and
still 0.32 ms slower with an ``http.client`` transport under it.  Nor ``http.client`` itself any
more: our connections (:class:`_Connection`) write a request's head — the bytes ``http.client``
writes, refused where it refuses — and body in one send, and parse the answer without the
``email`` package (:class:`_Response`) from a buffer kept for the connection.

Errors (all :class:`TransportError`): :class:`ConnectError` and :class:`ConnectTimeout` — no
connection, so nothing was sent (safe to retry any request); :class:`WriteError`,
:class:`ReadTimeout`, :class:`RemoteProtocolError` — the request may have reached the server.
An idle keep-alive connection that the server has closed (uvicorn closes them after a few
seconds) is noticed before it is reused (the socket reads as ready: an EOF is pending) and
replaced, so such a close is never mistaken for a failed request.
"""

from __future__ import annotations

import http.client
import re
import select
import socket
import threading
import time
from typing import Callable
from urllib.parse import urlencode, urlsplit

__all__ = ["Session", "Response", "TransportError", "ConnectError", "ConnectTimeout", "WriteError",
           "ReadTimeout", "RemoteProtocolError", "ResponseTooLarge", "MAX_RESPONSE_BYTES"]

#: the largest answer a Session reads (bytes): a one-message answer is ~1 kB, the default server's
#: largest (10 000 rows) ~3 MB; a server announcing or sending more is refused, never buffered
MAX_RESPONSE_BYTES = 256 * 2**20


class TransportError(OSError):
    """No (complete) answer.  ``sent``: whether the request can have reached the server."""

    sent = True


class ConnectError(TransportError):
    sent = False


class ConnectTimeout(ConnectError):
    pass


class WriteError(TransportError):
    pass


class ReadTimeout(TransportError):
    pass


class RemoteProtocolError(TransportError):
    pass


class ResponseTooLarge(RemoteProtocolError):
    """The answer is larger than the Session's ``max_response_bytes`` (not read past that)."""


class Response:
    """``status_code``, ``headers`` (case-insensitive ``get``), ``content`` (bytes), ``text``."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers, content: bytes):
        self.status_code = int(status_code)
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


_LEGAL_HEADER_NAME = re.compile(rb"[^:\s][^:\r\n]*").fullmatch  # http.client's rules (RFC 7230)
_ILLEGAL_HEADER_VALUE = re.compile(rb"\n(?![ \t])|\r(?![ \t\n])").search
_BAD_TARGET = re.compile("[\x00-\x20\x7f]").search
_BAD_METHOD = re.compile("[\x00-\x1f]").search
_BODY_METHODS = frozenset({"PATCH", "POST", "PUT"})  # sent with Content-Length: 0 when they have no body


def _head(method: str, target: str, headers: dict, content: bytes | None) -> bytes:
    """A request's head, byte for byte what ``http.client`` writes for ``request(method, target,
    body=content, headers=headers)`` (request line, ``Accept-Encoding: identity`` unless given,
    ``Content-Length`` unless given, then ``headers`` in order), refused as it refuses: a method
    with control characters or a bad header name or value (ValueError), a target with spaces or
    control characters (``http.client.InvalidURL``)."""
    if _BAD_METHOD(method):
        raise ValueError(f"method can't contain control characters. {method!r} (found at least "
                         f"{_BAD_METHOD(method).group()!r})")
    target = target or "/"
    if _BAD_TARGET(target):
        raise http.client.InvalidURL(f"URL can't contain control characters. {target!r} (found at least "
                                     f"{_BAD_TARGET(target).group()!r})")
    lines = [f"{method} {target} HTTP/1.1".encode("ascii")]
    names = {k.lower() for k in headers}
    if "accept-encoding" not in names:
        lines.append(b"Accept-Encoding: identity")
    if "content-length" not in names and "transfer-encoding" not in names:
        if content is not None:
            lines.append(b"Content-Length: %d" % len(content))
        elif method.upper() in _BODY_METHODS:
            lines.append(b"Content-Length: 0")
    for name, value in headers.items():
        name = name.encode("ascii") if isinstance(name, str) else bytes(name)
        if not _LEGAL_HEADER_NAME(name):
            raise ValueError(f"Invalid header name {name!r}")
        if isinstance(value, str):
            value = value.encode("latin-1")
        elif isinstance(value, int):
            value = str(value).encode("ascii")
        if _ILLEGAL_HEADER_VALUE(value):
            raise ValueError(f"Invalid header value {value!r}")
        lines.append(name + b": " + value)
    lines.append(b"")
    lines.append(b"")
    return b"\r\n".join(lines)


class _Reader:
    """Buffered reads of one connection's answers: ``readline(limit)`` and ``read(n)`` as a
    ``socket.makefile("rb")`` reader gives them, kept for the connection's life (not made per
    answer), with what is left over after an answer visible (:meth:`pending`)."""

    __slots__ = ("sock", "buf", "pos", "deadline", "timeout", "budget", "cap")

    def __init__(self, sock):
        self.sock = sock
        self.buf = b""
        self.pos = 0
        self.deadline = None  # (time.monotonic() by which the answer must be complete; None: none)
        gettimeout = getattr(sock, "gettimeout", None)  # (the socket's, as last set)
        self.timeout = gettimeout() if gettimeout is not None else None
        self.budget = None  # (bytes an answer, head included, may still bring; None: no limit)
        self.cap = None  # (the largest body an answer may have; None: no limit)

    def pending(self) -> int:
        return len(self.buf) - self.pos

    def settimeout(self, timeout) -> None:
        if timeout != self.timeout:
            self.sock.settimeout(timeout)
            self.timeout = timeout

    def _recv(self) -> bytes:
        """One ``recv``, within what is left of the deadline, and within the byte budget."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the answer took longer than the request's timeout")
            self.settimeout(left)
        data = self.sock.recv(65536)
        if self.budget is not None:
            self.budget -= len(data)
            if self.budget < 0:
                raise ResponseTooLarge("the answer is larger than the client accepts")
        return data

    def _fill(self) -> bool:
        data = self._recv()
        if not data:
            return False
        self.buf = self.buf[self.pos:] + data if self.pos < len(self.buf) else data
        self.pos = 0
        return True

    def readline(self, limit: int) -> bytes:
        """Up to and including the next newline, at most ``limit`` bytes; less at the end of the stream."""
        while True:
            i = self.buf.find(b"\n", self.pos, self.pos + limit)
            if i >= 0:
                line, self.pos = self.buf[self.pos:i + 1], i + 1
                return line
            if len(self.buf) - self.pos >= limit or not self._fill():
                line = self.buf[self.pos:self.pos + limit]
                self.pos += len(line)
                return line

    def read(self, n: int | None = None) -> bytes:
        """``n`` bytes (fewer at the end of the stream), or with None everything up to it."""
        if n is not None and n < 0:
            raise ValueError("read length must be non-negative")
        have = len(self.buf) - self.pos
        if n is not None and have >= n:
            out, self.pos = self.buf[self.pos:self.pos + n], self.pos + n
            return out
        parts, self.buf, self.pos = [self.buf[self.pos:]], b"", 0
        while n is None or have < n:
            data = self._recv()
            if not data:
                break
            parts.append(data)
            have += len(data)
        out = b"".join(parts)
        if n is not None and len(out) > n:
            out, self.buf = out[:n], out[n:]
        return out

    def close(self) -> None:
        self.buf, self.pos = b"", 0


class _Connection:
    """One HTTP/1.1 connection (plain or TLS) of a :class:`Session`: a request's head and body go
    out in one send — the standard library's ``http.client`` sends them separately, and on
    loopback each send costs the receiver a wake-up (measured ~0.1 ms a send on a 2-core VM) —
    with the head written by :func:`_head` (``http.client``'s bytes, its refusals); the answer is
    parsed by :class:`_Response` from a :class:`_Reader` kept for the connection.  Measured paired
    on loopback against a bare server answering a one-message request's bytes (8 000 interleaved
    rounds, twice): 31.1 / 30.5 µs a request less than the ``http.client`` connection it replaces
    (its per-header validation calls and per-answer ``makefile``)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = _Reader(sock)
        self._poll = None

    def stale(self) -> bool:
        """Whether the connection cannot carry a request: the server closed it (an EOF is pending:
        the socket reads as ready), or bytes no request asked for arrived."""
        if self.reader.pending():
            return True
        try:
            if self._poll is None:
                self._poll = select.poll()  # not select.select: it refuses fds >= 1024
                self._poll.register(self.sock, select.POLLIN)
            return bool(self._poll.poll(0))
        except (OSError, ValueError):
            return True

    def settimeout(self, timeout: float) -> None:
        self.reader.settimeout(timeout)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


class _Headers(dict):
    """A response's headers: names case-insensitive (kept lower-case); a repeated header keeps its
    first value, as ``http.client``'s ``HTTPMessage.get`` answers."""

    def __getitem__(self, name):
        return super().__getitem__(name.lower())

    def __contains__(self, name):
        return isinstance(name, str) and super().__contains__(name.lower())

    def get(self, name, default=None):
        return super().get(name.lower(), default)


_MAX_LINE = 65536
_MAX_HEADERS = 100  # http.client's limits
_MAX_HEAD_BYTES = 65536  # what an answer's head may add to the body's cap in bytes read


class _Response:
    """An answer on a :class:`_Connection`, read as ``http.client``'s ``HTTPResponse`` reads one
    (``begin``, ``read``, ``isclosed``, ``close``, ``status``, ``headers``, ``will_close``; the
    tests compare the two on the same bytes — stricter where they differ: a status line with two
    spaces after the version or a bad Content-Length is an error here, ``HTTP/2.0`` is read as
    1.1, ``Transfer-Encoding: gzip, chunked`` is de-chunked), with the status line and headers parsed here
    instead of by the ``email`` package — ~40 % of a one-message request's client time in ``http.client``.  The body
    by Content-Length, chunked, or up to the connection's close; 1xx answers are skipped; HEAD,
    204 and 304 answers have none.  A malformed or cut answer raises ``http.client``'s exceptions."""

    def __init__(self, sock, debuglevel=0, method=None, url=None, reader: _Reader | None = None):
        # (a Session's connection passes its reader; otherwise, as http.client, a reader of the socket)
        self.fp = reader if reader is not None else _Reader(sock)
        self._method = method
        self.status = self.reason = self.headers = None
        self.version = 11
        self.length = None
        self.chunked = False
        self.will_close = True

    def _line(self, what: str) -> bytes:
        line = self.fp.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            raise http.client.LineTooLong(what)
        return line

    def begin(self) -> None:
        while True:
            line = self._line("status line")
            if not line:
                raise http.client.RemoteDisconnected("Remote end closed connection without response")
            version, _, rest = line.decode("iso-8859-1").rstrip("\r\n").partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/") or len(code) != 3 or not (code.isascii() and code.isdigit()):
                raise http.client.BadStatusLine(line.decode("iso-8859-1", "replace"))
            headers, last = _Headers(), None
            for _ in range(_MAX_HEADERS + 1):
                h = self._line("header line")
                if h in (b"\r\n", b"\n", b""):
                    break
                text = h.decode("iso-8859-1").rstrip("\r\n")
                if text[:1] in (" ", "\t") and last is not None:  # an obsolete folded continuation
                    headers[last] = headers[last] + " " + text.strip()
                    continue
                name, _, value = text.partition(":")
                last = name.strip().lower()
                dict.setdefault(headers, last, value.strip())
            else:
                raise http.client.HTTPException(f"got more than {_MAX_HEADERS} headers")
            status = int(code)
            if 100 <= status < 200 and status != 101:
                continue  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            break
        self.status, self.reason, self.headers = status, reason.strip(), headers
        self.version = 10 if version == "HTTP/1.0" else 11
        connection = headers.get("connection", "").lower()
        self.will_close = "close" in connection or (self.version == 10 and "keep-alive" not in connection)
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if self._method == "HEAD" or status in (204, 304) or status < 200:
            self.length, self.chunked = 0, False
        elif not self.chunked:
            n = headers.get("content-length")
            if n is not None:
                try:
                    self.length = int(n)
                except ValueError:
                    raise http.client.HTTPException(f"bad Content-Length {n!r}") from None
                if self.length < 0:
                    raise http.client.HTTPException(f"bad Content-Length {n!r}")
                cap = self.fp.cap if isinstance(self.fp, _Reader) else None
                if cap is not None and self.length > cap:
                    raise ResponseTooLarge(f"the answer announces {self.length} bytes, more than the client "
                                           f"accepts ({cap})")
            else:
                self.will_close = True  # the body ends where the connection does

    def read(self) -> bytes:
        if self.fp is None:
            return b""
        try:
            if self.chunked:
                return self._read_chunked()
            if self.length is None:
                return self.fp.read()
            body = self.fp.read(self.length)
            if len(body) < self.length:
                raise http.client.IncompleteRead(body, self.length - len(body))
            return body
        finally:
            self.close()

    def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = self._line("chunk size").split(b";", 1)[0].strip()
            try:
                if not size or size.strip(b"0123456789abcdefABCDEF"):
                    raise ValueError(size)
                n = int(size, 16)
            except ValueError:
                raise http.client.IncompleteRead(b"".join(parts)) from None
            if n == 0:
                break
            data = self.fp.read(n)
            if len(data) < n:
                raise http.client.IncompleteRead(b"".join(parts) + data, n - len(data))
            parts.append(data)
            self._line("chunk end")
        while self._line("trailer") not in (b"\r\n", b"\n", b""):  # trailers: ignored
            pass
        return b"".join(parts)

    def isclosed(self) -> bool:
        return self.fp is None

    def close(self) -> None:
        self.fp = None  # (the reader is the connection's: what is left in it decides its staleness)


class Session:
    """Requests to one server (``base_url``: scheme, host, port and an optional path prefix) over
    one keep-alive connection.  ``timeout``: seconds for sending a request, and for its whole
    answer; ``connect_timeout``: for opening the connection; ``max_response_bytes``: the largest
    answer read (:class:`ResponseTooLarge` beyond).  Requests from several threads take turns
    on the connection.  ``on_request``: callables given ``(method, url, {"connect": s, "read": s})``
    before each attempt is sent (a seam for tests and logging)."""

    def __init__(self, base_url: str, headers: dict | None = None, timeout: float = 60.0,
                 connect_timeout: float = 5.0, max_response_bytes: int = MAX_RESPONSE_BYTES):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"`url` must be http(s)://host[:port][/prefix], got {base_url!r}")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
        self.headers = {"Host": host + (f":{u.port}" if u.port else ""), "Connection": "keep-alive"}
        if u.username is not None:  # as httpx: userinfo becomes Basic auth, never part of Host
            import base64
            from urllib.parse import unquote
            cred = f"{unquote(u.username)}:{unquote(u.password or '')}".encode()
            self.headers["Authorization"] = "Basic " + base64.b64encode(cred).decode()
        self.headers.update(headers or {})
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.max_response_bytes = int(max_response_bytes)
        self.on_request: list[Callable] = []
        self._conn: _Connection | None = None
        self._last_query: tuple[tuple, str] | None = None
        self._tls = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ connection
    def close(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            c.close()

    def __del__(self):
        # a session dropped without close() closes its socket (found by a new-user audit: a RemoteOperator
        # garbage-collected unclosed left it open, a ResourceWarning)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - (interpreter shutdown: nothing to report to)
            pass

    def _connection(self) -> _Connection:
        c = self._conn
        if c is not None:
            if not c.stale():  # an idle connection the server closed reads as ready (EOF): replace it
                return c
        self.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except socket.timeout as exc:
            raise ConnectTimeout(f"connecting to {self.host}:{self.port} timed out after "
                                 f"{self.connect_timeout:g} s") from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.scheme == "https":
                sock = self._tls_context().wrap_socket(sock, server_hostname=self.host)
        except socket.timeout as exc:
            sock.close()
            raise ConnectTimeout(f"the TLS handshake with {self.host}:{self.port} timed out after "
                                 f"{self.connect_timeout:g} s") from exc
        except OSError as exc:
            sock.close()
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self._conn = c = _Connection(sock)
        return c

    def _tls_context(self):
        """The TLS context ``http.client.HTTPSConnection`` builds (``ssl._create_default_https_context``,
        the documented hook to change verification, PEP 476; ALPN ``http/1.1``; post-handshake
        authentication), made once per Session."""
        ctx = self._tls
        if ctx is None:
            import ssl

            ctx = ssl._create_default_https_context()
            ctx.set_alpn_protocols(["http/1.1"])
            if getattr(ctx, "post_handshake_auth", None) is not None:
                ctx.post_handshake_auth = True
            self._tls = ctx
        return ctx

    # ------------------------------------------------------------------ requests
    def request(self, method: str, path: str, *, params: dict | None = None, content: bytes | None = None,
                headers: dict | None = None) -> Response:
        """One attempt (no retries: the caller decides, from the error's ``sent``)."""
        with self._lock:
            return self._request(method, path, params, content, headers)

    def _query(self, params: dict) -> str:
        """``urlencode(params)``, the last one kept (a client asks in one mode, call after call)."""
        items = tuple(params.items())
        if not all(type(k) is str and type(v) is str for k, v in items):
            return urlencode(params)
        last = self._last_query
        if last is not None and last[0] == items:
            return last[1]
        q = urlencode(params)
        self._last_query = (items, q)
        return q

    def _request(self, method, path, params, content, headers) -> Response:
        url = self.prefix + path + (("&" if "?" in path else "?") + self._query(params) if params else "")
        for hook in self.on_request:
            hook(method, url, {"connect": self.connect_timeout, "read": self.timeout})
        if headers:
            own = {k.lower() for k in headers}
            hdrs = {**{k: v for k, v in self.headers.items() if k.lower() not in own}, **headers}
        else:
            hdrs = self.headers
        head = _head(method, url, hdrs, content)  # (refused here: nothing sent, the connection untouched)
        conn = self._connection()
        self._conn = None  # (back only after a complete answer: an interrupt anywhere leaves it out)
        try:
            conn.settimeout(self.timeout)
            conn.send(head + content if content is not None else head)
        except socket.timeout as exc:
            conn.close()
            raise WriteError(f"sending to {self.host}:{self.port} timed out after {self.timeout:g} s") from exc
        except OSError as exc:
            conn.close()
            raise WriteError(f"sending to {self.host}:{self.port} failed: {exc}") from exc
        except BaseException:  # interrupted: unknown state
            conn.close()
            raise
        reader = conn.reader
        try:
            # the whole answer within the timeout (a server dripping bytes cannot hold a call
            # forever), and no larger than the client accepts (found by an audit: 400 MB buffered)
            reader.deadline, reader.cap = time.monotonic() + self.timeout, self.max_response_bytes
            reader.budget = self.max_response_bytes + _MAX_HEAD_BYTES
            r = _Response(conn.sock, method=method, reader=reader)
            r.begin()
            data = r.read()
        except socket.timeout as exc:
            conn.close()
            raise ReadTimeout(f"no complete answer from {self.host}:{self.port} within {self.timeout:g} s") from exc
        except ResponseTooLarge as exc:
            conn.close()
            raise ResponseTooLarge(f"{self.host}:{self.port}: {exc}") from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise RemoteProtocolError(f"the connection to {self.host}:{self.port} broke before a complete "
                                      f"answer ({type(exc).__name__}: {exc})") from exc
        except BaseException:  # e.g. KeyboardInterrupt: the answer may still come on this connection
            conn.close()
            raise
        reader.deadline = reader.budget = reader.cap = None
        if r.will_close:
            conn.close()
        else:
            self._conn = conn
        return Response(r.status, r.headers, data)


class HttpxSession:
    """The :class:`Session` interface over a caller's ``httpx.Client`` (its base URL, headers and
    transport), with httpx's errors mapped to this module's.  The client's own timeouts apply (httpx
    bounds each read, not a whole answer) and no size cap: the caller configured that client."""

    def __init__(self, client, headers: dict | None = None):
        self.client = client
        self.on_request: list[Callable] = []
        if headers:
            client.headers.update(headers)

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, path: str, *, params: dict | None = None, content: bytes | None = None,
                headers: dict | None = None) -> Response:
        import httpx

        req = self.client.build_request(method, path, params=params, content=content, headers=headers)
        for hook in self.on_request:
            t = req.extensions.get("timeout", {})
            hook(method, str(req.url), {"connect": t.get("connect"), "read": t.get("read")})
        try:
            r = self.client.send(req)
        except httpx.ConnectTimeout as exc:
            raise ConnectTimeout(str(exc)) from exc
        except httpx.ConnectError as exc:
            raise ConnectError(str(exc)) from exc
        except httpx.ReadTimeout as exc:
            raise ReadTimeout(str(exc)) from exc
        except (httpx.WriteError, httpx.WriteTimeout) as exc:
            raise WriteError(str(exc)) from exc
        except httpx.TransportError as exc:
            raise RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc
        return Response(r.status_code, r.headers, r.content)
