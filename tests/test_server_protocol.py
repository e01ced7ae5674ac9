"""service/protocol.py: a response's head and body reach the socket in one write, and the bytes on
the wire are exactly those of uvicorn's own protocol — checked on uvicorn's real protocol code with
a recording transport, for a one-shot response, a streamed one, keep-alive and a held head alone."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from service.protocol import HeadHoldingTransport, OneWriteHttpToolsProtocol


class RecordingTransport(asyncio.Transport):
    """Collects writes; closed on close/abort."""

    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data):
        assert not self.closed, "write after close"
        self.writes.append(bytes(data))

    def close(self):
        self.closed = True

    def abort(self):
        self.aborted = self.closed = True

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


# ---------------------------------------------------------------------- the transport alone
def test_a_head_and_the_body_after_it_are_one_write():
    async def main():
        raw = RecordingTransport()
        t = HeadHoldingTransport(raw, asyncio.get_running_loop())
        t.write(HEAD)
        assert raw.writes == []  # held
        t.write(memoryview(b"{}"))
        assert raw.writes == [HEAD + b"{}"]
        await asyncio.sleep(0)  # the scheduled flush finds nothing held
        assert raw.writes == [HEAD + b"{}"]
    run(main())


def test_a_head_alone_is_written_on_the_next_loop_iteration():
    async def main():
        raw = RecordingTransport()
        t = HeadHoldingTransport(raw, asyncio.get_running_loop())
        t.write(HEAD)
        await asyncio.sleep(0)
        assert raw.writes == [HEAD]
        t.write(b"{}")  # a later body is its own write
        assert raw.writes == [HEAD, b"{}"]
    run(main())


def test_other_writes_pass_through_and_close_flushes_abort_drops():
    async def main():
        loop = asyncio.get_running_loop()
        raw = RecordingTransport()
        t = HeadHoldingTransport(raw, loop)
        t.write(b"HTTP/1.1 200 OK\r\n")  # not a complete head
        t.write(b"body")
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n", b"body"]
        t.write(HEAD)
        t.close()
        assert raw.writes[-1] == HEAD and raw.closed
        raw2 = RecordingTransport()
        t2 = HeadHoldingTransport(raw2, loop)
        t2.write(HEAD)
        t2.abort()
        await asyncio.sleep(0)
        assert raw2.writes == [] and raw2.aborted
        assert t2.get_extra_info("peername") == ("127.0.0.1", 5000)  # everything else is the transport's
    run(main())


# ---------------------------------------------------------------------- uvicorn's protocol on it
async def _one_shot(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    body = b'{"ok":true}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _streamed(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await asyncio.sleep(0.01)  # the head must not wait for a slow body
    await send({"type": "http.response.body", "body": b"one", "more_body": True})
    await send({"type": "http.response.body", "body": b"two"})


REQUEST = b"POST /v1/x?mode=predict HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}"


async def _serve(protocol_cls, app, requests, wait=0.05):
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    config.load()
    proto = protocol_cls(config, ServerState(), {}, _loop=asyncio.get_running_loop())
    raw = RecordingTransport()
    proto.connection_made(raw)
    out = []
    for req in requests:
        raw.writes.clear()
        proto.data_received(req)
        for _ in range(200):
            await asyncio.sleep(wait / 100)
            if proto.cycle is not None and proto.cycle.response_complete:
                break
        await asyncio.sleep(0)
        out.append(list(raw.writes))
    proto.connection_lost(None)
    return out


@pytest.mark.parametrize("app", [_one_shot, _streamed], ids=["one_shot", "streamed"])
def test_the_same_bytes_as_uvicorns_protocol(app):
    ours = run(_serve(OneWriteHttpToolsProtocol, app, [REQUEST, REQUEST]))
    theirs = run(_serve(HttpToolsProtocol, app, [REQUEST, REQUEST]))
    assert [b"".join(w) for w in ours] == [b"".join(w) for w in theirs]
    assert all(b"".join(w).startswith(b"HTTP/1.1 200 OK\r\n") for w in ours)
    if app is _one_shot:
        # every keep-alive answer: head and body in one write (uvicorn's own: two)
        assert [len(w) for w in ours] == [1, 1] and [len(w) for w in theirs] == [2, 2]
        assert ours[0][0].endswith(b'\r\n\r\n{"ok":true}')
    else:
        # streamed: the head goes out on its own once the loop turns (not held for the slow body)
        assert all(w[0].startswith(b"HTTP/1.1 200 OK") and w[0].endswith(b"\r\n\r\n") for w in ours)


def test_serve_runs_uvicorn_on_this_protocol(tmp_path, monkeypatch):
    from service.server import serve
    from service.settings import Settings

    seen = {}

    def fake_run(self, sockets=None):
        self.config.load()
        seen["cls"] = self.config.http_protocol_class
        self.should_exit = True

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    settings = Settings.from_env(store=str(tmp_path / "store"), port=0, default_operators=())
    assert serve(settings, train_defaults=False) == 0
    assert issubclass(seen["cls"], OneWriteHttpToolsProtocol)
    assert seen["cls"].max_head_bytes == settings.max_head_bytes


# ---------------------------------------------------------------------- the request head is bounded
def _big_head(n):
    return b"POST /v1/x HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * n + b"\r\nContent-Length: 2\r\n\r\n{}"


@pytest.mark.parametrize("pieces", [1, 3, 50], ids=["one_read", "three_reads", "fifty_reads"])
def test_a_head_beyond_the_bound_is_a_431_in_one_read_or_many(pieces):
    """Whether the head completes in the read that crossed the bound (measured exactly) or not (the
    read count): 431 with the service's error body, connection: close, and the app never runs."""
    proto_cls = OneWriteHttpToolsProtocol.with_limits(max_head_bytes=1000)
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["path"])
        await _one_shot(scope, receive, send)

    async def main():
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        config.load()
        proto = proto_cls(config, ServerState(), {}, _loop=asyncio.get_running_loop())
        raw = RecordingTransport()
        proto.connection_made(raw)
        data = _big_head(3000)
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            if raw.closed:
                break
            proto.data_received(data[i:i + step])
        for _ in range(20):
            await asyncio.sleep(0)
        proto.connection_lost(None)
        return b"".join(raw.writes), raw.closed

    out, was_closed = run(main())
    assert out.startswith(b"HTTP/1.1 431 ") and b"connection: close\r\n" in out.lower(), out[:200]
    assert b'"type": "header_too_large"' in out and was_closed and calls == []


def test_a_head_within_the_bound_is_served_whatever_the_reads_carry():
    """The count covers reads before a head's end: a large body in the head's read, or a second
    request after it on the same connection, is not counted against the head."""
    proto_cls = OneWriteHttpToolsProtocol.with_limits(max_head_bytes=1000)
    body = b"x" * 5000
    request = b"POST /v1/x HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n" + body
    answers = run(_serve(proto_cls, _one_shot, [request, request, _big_head(900)]))
    assert [b"".join(w)[:15] for w in answers] == [b"HTTP/1.1 200 OK"] * 3
