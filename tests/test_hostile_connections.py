"""Hostile connections against a real server (found by an audit): an unbounded request head (a 64 MiB
header answered 200 after 3.5 s, the event loop stalled), connections that send nothing, stop
mid-head or stall mid-body (never closed: with ``ulimit -n 1024``, 1 100 of them locked every
client out).  Raw sockets, small sizes; the server runs the service's protocol (service/protocol.py)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from service.testing import ThreadedServer

from test_service_fixtures import TOKEN, pristine_store, settings_for, store_dir  # noqa: F401 - fixtures

PREDICT = "/v1/operators/logistic-x/messages?mode=predict"
BODY = json.dumps({"to": "x", "incoming": {"x": {"family": "gaussian", "mean": [0.0], "var": [1.0]},
                                           "z": {"family": "beta", "alpha": [2.0], "beta": [1.0]}}}).encode()


def head(path=PREDICT, extra: bytes = b"", length: int = len(BODY)) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n").encode() + extra + b"\r\n"


def connect(srv, timeout=10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)


def read_answer(s: socket.socket, check_closed: bool = True) -> tuple[int, dict, bytes, bool]:
    """(status, headers, body, closed): one response, then (``check_closed``) whether the server closed
    the connection."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        b = s.recv(65536)
        if not b:
            raise ConnectionError(f"closed before an answer: {buf[:200]!r}")
        buf += b
    top, _, body = buf.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers.get("content-length", 0))
    while len(body) < n:
        b = s.recv(65536)
        if not b:
            break
        body += b
    return status, headers, body, check_closed and closed(s)


def closed(s: socket.socket, wait: float = 5.0) -> bool:
    """Did the server close the connection (EOF or reset within ``wait`` s)?"""
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def send_all(s: socket.socket, data: bytes) -> None:
    """Send, tolerating the server closing early (it answers before reading everything)."""
    try:
        s.sendall(data)
    except OSError:
        pass


@pytest.fixture
def live(store_dir):  # noqa: F811
    with ThreadedServer(settings_for(store_dir)) as srv:
        yield srv


# ------------------------------------------------------------------------------ A: the request head is bounded
def test_a_request_head_beyond_the_limit_is_a_431_and_the_connection_closes(live):
    s = connect(live)
    t = time.perf_counter()
    send_all(s, head(extra=b"X-Pad: " + b"a" * (1 << 20) + b"\r\n") + BODY)  # a 1 MiB header, no token needed
    status, headers, body, was_closed = read_answer(s)
    assert status == 431, body[:300]
    assert time.perf_counter() - t < 5
    detail = json.loads(body)["detail"]
    assert detail[0]["type"] == "header_too_large" and detail[0]["loc"] == ["header"]
    assert "KJIT_MAX_HEAD_BYTES" in detail[0]["msg"] and len(body) < 1000
    assert headers["connection"] == "close" and was_closed
    s.close()
    # a long URL is part of the head too
    s = connect(live)
    send_all(s, head(path=PREDICT + "&x=" + "a" * (256 << 10)) + BODY)
    assert read_answer(s)[0] == 431
    s.close()
    # a head just under the limit (64 KiB) is served, and so is the next request
    s = connect(live)
    s.sendall(head(extra=b"X-Pad: " + b"a" * (60 << 10) + b"\r\n") + BODY)
    status, _, body, _ = read_answer(s, check_closed=False)
    assert status == 200, body[:300]
    s.close()
    assert httpx.get(live.url + "/health").status_code == 200


def test_the_head_limit_is_a_setting(store_dir):  # noqa: F811
    from service.settings import Settings

    assert Settings.from_env({"KJIT_MAX_HEAD_BYTES": "4096"}).max_head_bytes == 4096
    with pytest.raises(ValueError, match="max_head_bytes"):
        Settings.from_env({"KJIT_MAX_HEAD_BYTES": "0"})
    with ThreadedServer(settings_for(store_dir, max_head_bytes=4096)) as srv:
        s = connect(srv)
        send_all(s, head(extra=b"X-Pad: " + b"a" * 5000 + b"\r\n") + BODY)
        assert read_answer(s)[0] == 431
        s.close()
        r = httpx.post(srv.url + PREDICT, content=BODY, headers={"X-Pad": "a" * 3000, "Content-Type": "application/json"})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ B: a request must arrive in time
FAST = dict(head_timeout=0.5, body_timeout=0.5, min_body_rate=100)


@pytest.fixture
def quick(store_dir):  # noqa: F811
    """A server whose head and body timeouts are 0.5 s (a body then keeps up 100 B/s)."""
    with ThreadedServer(settings_for(store_dir, **FAST)) as srv:
        yield srv


def timed_close(s: socket.socket, within: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s from now)."""
    t, out = time.perf_counter(), b""
    s.settimeout(within)
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            out += b
    except socket.timeout:
        raise AssertionError(f"still open after {within} s; read {out[:200]!r}") from None
    except OSError:
        pass
    return out, time.perf_counter() - t


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(quick):
    s = connect(quick)
    out, dt = timed_close(s)
    assert out == b"" and dt < 5
    s.close()


def test_a_head_that_stops_midway_is_a_408_and_closed(quick):
    s = connect(quick)
    s.sendall(b"POST " + PREDICT.encode() + b" HTTP/1.1\r\nHost: t\r\n")
    out, dt = timed_close(s)
    assert out.startswith(b"HTTP/1.1 408 ") and b"connection: close" in out.lower() and dt < 5, out[:300]
    detail = json.loads(out.partition(b"\r\n\r\n")[2])["detail"]
    assert detail[0]["type"] == "request_timeout" and detail[0]["loc"] == ["header"]
    assert "KJIT_HEAD_TIMEOUT" in detail[0]["msg"]
    s.close()
    # the next head on a kept-alive connection has its own deadline, from its first byte
    s = connect(quick)
    s.sendall(head() + BODY)
    assert read_answer(s, check_closed=False)[0] == 200
    time.sleep(0.7)  # longer than the head timeout, within uvicorn's keep-alive (5 s): still open
    s.sendall(head() + BODY)
    assert read_answer(s, check_closed=False)[0] == 200
    s.sendall(b"POST / HTTP/1.1\r\n")
    out, _ = timed_close(s)
    assert out.startswith(b"HTTP/1.1 408 ")
    s.close()


def test_a_body_that_stalls_is_a_408_and_closed_and_a_slow_but_steady_one_is_served(quick):
    s = connect(quick)
    s.sendall(head() + BODY[:10])
    out, dt = timed_close(s)
    assert out.startswith(b"HTTP/1.1 408 ") and dt < 5, out[:300]
    detail = json.loads(out.partition(b"\r\n\r\n")[2])["detail"]
    assert detail[0]["type"] == "request_timeout" and detail[0]["loc"] == ["body"]
    s.close()
    # a trickle slower than the minimum rate is cut off too (20 B/s here, 100 B/s asked)
    s = connect(quick)
    s.sendall(head(length=1000) + b" ")
    t = time.perf_counter()
    with pytest.raises((AssertionError, OSError)):
        while time.perf_counter() - t < 8:
            s.sendall(b" ")
            time.sleep(0.05)
            if closed(s, 0.0):
                raise AssertionError("closed")
    assert time.perf_counter() - t < 5
    s.close()
    # a body arriving in pieces for longer than the timeout, faster than the rate, is served
    s = connect(quick)
    s.sendall(head())
    for i in range(0, len(BODY), 40):
        time.sleep(0.25)
        s.sendall(BODY[i:i + 40])
    assert read_answer(s, check_closed=False)[0] == 200
    s.close()


def test_the_largest_body_over_loopback_is_not_timed_out(store_dir):  # noqa: F811
    with ThreadedServer(settings_for(store_dir, max_body_bytes=16 << 20, body_timeout=0.5)) as srv:
        s = connect(srv, timeout=60)
        big = b" " * ((16 << 20) - 2) + b"{}"
        s.sendall(head(length=len(big)) + big)
        status, _, body, _ = read_answer(s, check_closed=False)
        assert status == 422, body[:300]  # parsed (an empty object), not cut off
        s.close()


def test_idle_connections_are_closed_and_the_server_keeps_serving(quick):
    """The audit's lock-out, small: connections that send nothing, half a head, or a stalled body."""
    socks = []
    for i in range(60):
        k = connect(quick)
        if i % 3 == 1:
            k.sendall(b"POST " + PREDICT.encode() + b" HTTP/1.1\r\nHost: x\r\n")
        elif i % 3 == 2:
            k.sendall(head(length=100) + b"{")
        socks.append(k)
    time.sleep(2.0)
    answers = [timed_close(k, 2.0)[0][:12] for k in socks]  # (fails if one is still open)
    assert answers == [b"", b"HTTP/1.1 408", b"HTTP/1.1 408"] * 20
    for k in socks:
        k.close()
    assert httpx.post(quick.url + PREDICT, content=BODY, headers={"Content-Type": "application/json"}).status_code == 200


def test_the_timeouts_are_settings_and_kjit_serve_raises_the_open_files_limit():
    import subprocess
    import sys

    from service.settings import Settings

    s = Settings.from_env({"KJIT_HEAD_TIMEOUT": "2.5", "KJIT_BODY_TIMEOUT": "7", "KJIT_MIN_BODY_RATE": "1000"})
    assert (s.head_timeout, s.body_timeout, s.min_body_rate) == (2.5, 7.0, 1000)
    for key, bad in (("KJIT_HEAD_TIMEOUT", "0"), ("KJIT_BODY_TIMEOUT", "inf"), ("KJIT_MIN_BODY_RATE", "0")):
        with pytest.raises(ValueError):
            Settings.from_env({key: bad})
    code = ("import resource; from service.server import raise_open_files_limit as r; "
            "s, h = resource.getrlimit(resource.RLIMIT_NOFILE); resource.setrlimit(resource.RLIMIT_NOFILE, (256, h)); "
            "print(r(), resource.getrlimit(resource.RLIMIT_NOFILE), h)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(")")
    before_after, now = eval(out[0] + ")"), eval(out[1] + ")")
    hard = int(out[2])
    want = min(hard, 1 << 20) if hard >= 0 else 1 << 20
    assert before_after == (256, want) and now[0] == want


def test_an_app_s_wait_before_a_100_continue_is_not_the_client_s(tmp_path):
    """Found in review: with ``Expect: 100-continue`` the client sends its body only after the 100, which the
    app's first receive() sends; an app that waited longer than the body timeout before reading made the
    client's request a 408 at 0.5 s — a wait of the server's counted against the client."""
    import asyncio
    import threading

    import uvicorn

    from service.server import uvicorn_config
    from service.settings import Settings

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (m := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await asyncio.sleep(1.2)  # (longer than the body timeout) before reading the body
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        out = json.dumps({"n": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    settings = Settings(store=tmp_path, head_timeout=0.5, body_timeout=0.5, min_body_rate=1000)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        s = socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=10)
        s.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 100"), first[:80]
        s.sendall(b"hello")
        status, _, body, _ = read_answer(s, check_closed=False)
        assert status == 200 and json.loads(body) == {"n": 5}
        s.close()
    finally:
        server.should_exit = True
        thread.join(10)
