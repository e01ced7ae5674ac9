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
